"""Every command on every model kind (issue 41): eval, generate, export --format hf and prune-heads on each kind
of run, from the LSTM LM (every gate, hierarchical MoE, the dense baselines) to the transformer (MHA, MoA and
MAE attention, a dense or an MoE FFN; the llama block, Mixtral's, Qwen2-MoE's, Llama's and Qwen3's architecture,
exported as transformers' own classes), with the adaptive and the sampled softmax, word and BPE tokenizers.

Each cell works, checked against an independent computation, or is refused in one line where the command says
it does not apply (prune-heads: transformer runs with --attention mha or mae). eval equals the training run's
own validation pass; generate --greedy equals re-running the whole sequence in this process each step; the
export loads in transformers with moe_scale's buffers and logits, and the documented per-word perplexity code
(docs/using-a-run.md) reproduces eval's; prune-heads' unpruned perplexity equals the model's own on its windows.
Each kind is trained once (TINY, 2 steps, a small WikiText-2 corpus) when a test first needs it."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from tests.cli_runs import TINY, assert_one_line_error, run_cli, run_eval, run_train
from tests.docs_code import code_blocks, run_python, section
from tests.paths import REPO
from tests.wikitext import wikitext_sentences

_TRANSFORMER = ["--model", "transformer", "--num-layers", "2", "--ffn-hidden", "32"]
_MOA = ["--attention", "moa", "--moa-num-experts", "4", "--moa-top-k", "2"]
KINDS = {
    "lstm-moe": [],
    "lstm-moe-hierarchical": ["--gate", "hierarchical", "--num-groups", "4", "--top-k-secondary", "2"],
    "lstm-moe-softmax-topk": ["--gate", "softmax_topk"],
    "lstm-moe-batchwise": ["--gate", "batchwise"],
    "lstm-ffn-lstm": ["--layout", "lstm-ffn-lstm"],
    "lstm-moe-adaptive": ["--softmax", "adaptive", "--adaptive-cutoffs", "50,200"],
    "lstm-moe-sampled": ["--softmax", "sampled", "--num-sampled", "50"],
    "lstm-moe-bpe": ["--tokenizer", "bpe"],
    "transformer-mha-dense": [*_TRANSFORMER, "--attention", "mha"],
    "transformer-mha-moe": [*_TRANSFORMER, "--attention", "mha", "--ffn", "moe"],
    "transformer-moa-dense": [*_TRANSFORMER, *_MOA],
    "transformer-moa-moe": [*_TRANSFORMER, *_MOA, "--ffn", "moe"],
    "transformer-mae-dense": [*_TRANSFORMER, "--attention", "mae"],
    "transformer-mae-moe": [*_TRANSFORMER, "--attention", "mae", "--ffn", "moe"],
    "transformer-mha-adaptive-bpe": [*_TRANSFORMER, "--attention", "mha", "--softmax", "adaptive",
                                     "--adaptive-cutoffs", "50,200", "--tokenizer", "bpe"],
    "transformer-mae-moe-sampled-unigram": [*_TRANSFORMER, "--attention", "mae", "--ffn", "moe", "--softmax",
                                            "sampled", "--sampler", "unigram", "--num-sampled", "50"],
    "transformer-llama-moe": [*_TRANSFORMER, "--block", "llama", "--ffn", "moe"],   # Mixtral
    "transformer-llama-moe-shared": [*_TRANSFORMER, "--block", "llama", "--ffn", "moe", "--shared-experts", "1",
                                     "--shared-expert-gate"],   # Qwen2-MoE
    "transformer-llama-dense-tied-sampled-bpe": [*_TRANSFORMER, "--block", "llama", "--tie-embeddings", "--softmax",
                                                 "sampled", "--num-sampled", "50", "--tokenizer", "bpe"],   # Llama
    "transformer-llama-dense-qk-norm": [*_TRANSFORMER, "--block", "llama", "--qk-norm", "--rms-norm-eps",
                                        "1e-6"],   # Qwen3
}
NATIVE = {kind for kind, flags in KINDS.items() if "llama" in flags}   # exported as transformers' own classes
PRUNABLE = {kind for kind, flags in KINDS.items() if "transformer" in flags and "moa" not in flags}
DOCS = REPO / "docs" / "using-a-run.md"
EXPORT_SECTION = "Exporting to HuggingFace transformers"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """train.txt, valid.txt and test.txt: WikiText-2 sentences, small enough for a full evaluation in a moment."""
    root = tmp_path_factory.mktemp("kinds_corpus")
    valid, test = wikitext_sentences("valid"), wikitext_sentences("test")
    for name, sentences in (("train.txt", valid[:600]), ("valid.txt", valid[600:624]), ("test.txt", test[:24])):
        (root / name).write_text("\n".join(sentences) + "\n", encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus, embedded_cache):
    """trained(kind) -> its run directory, trained on first use (2 steps, the validation pass over all of
    valid.txt). Shared by the module's tests, which do not change it."""
    runs: dict[str, Path] = {}

    def train(kind: str) -> Path:
        if kind not in runs:
            run = tmp_path_factory.mktemp(kind) / "run"
            run_train([*_tiny(KINDS[kind]), *KINDS[kind], "--data", str(corpus / "train.txt"), "--valid-data",
                       str(corpus / "valid.txt"), "--test-data", str(corpus / "test.txt"), "--vocab-size", "400",
                       "--max-steps", "2", "--eval-max-batches", "0", "--out", str(run)],
                      cwd=run.parent, cache=embedded_cache)
            runs[kind] = run
        return runs[kind]

    return train


@pytest.fixture(scope="module")
def opened(trained):
    """opened(kind) -> the run opened in this process by moe_scale (open_trained_run), on first use."""
    from moe_scale.inference.trained_run import open_trained_run

    models = {}

    def open_run(kind: str):
        if kind not in models:
            environment = dict(os.environ)   # the in-process load sets RANK, MASTER_PORT, ...: keep them from the CLI
            try:
                models[kind] = open_trained_run(trained(kind), None, "test")
            finally:
                os.environ.clear()
                os.environ.update(environment)
        return models[kind]

    return open_run


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The models this process runs use one thread, as each command does (OMP_NUM_THREADS=1): two threads on a
    shared 2-core machine wait for each other at every operation."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _tiny(flags: list[str]) -> list[str]:
    """TINY without the expert flags a kind refuses (they do nothing there): all of them without an MoE layer,
    all but the FFN's width for the LSTM's dense FFN."""
    moe = "moe" in flags if "transformer" in flags else "lstm-ffn-lstm" not in flags
    dropped = () if moe else ("--num-experts", "--top-k") if "lstm-ffn-lstm" in flags else \
        ("--num-experts", "--top-k", "--expert-hidden")
    args = list(TINY)
    for flag in dropped:
        at = args.index(flag)
        del args[at:at + 2]
    return args


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


# ---------------------------------------------------------------- eval


@pytest.mark.parametrize("kind", KINDS)
def test_eval(kind, trained, embedded_cache):
    run = trained(kind)
    result = run_eval(["--run", str(run)], cwd=run.parent, cache=embedded_cache)
    assert math.isfinite(result["ppl"]) and result["ppl"] > 1
    assert result["ppl"] == pytest.approx(_summary(run)["valid_ppl"], rel=1e-6)
    assert result["words_predicted"] == result["words"] + result["sentences"]
    assert (result["tokens"] == result["words_predicted"]) == ("bpe" not in kind)   # BPE: pieces per word


# ---------------------------------------------------------------- generate


@torch.no_grad()
def _greedy_rerunning(model, prompt_ids: list[int], max_new: int) -> tuple[list[int], bool]:
    """Greedy continuation by running the whole sequence every step (no cache): the ids and whether it ended."""
    from moe_scale.data import Vocab

    sequence = [Vocab.BOS_ID, *prompt_ids]
    new = []
    for _ in range(max_new):
        token = int(model.decode(torch.tensor([sequence]))[0][0, -1].argmax())
        if token == Vocab.EOS_ID:
            return new, True
        new.append(token)
        sequence.append(token)
    return new, False


@pytest.mark.parametrize("kind", KINDS)
def test_generate(kind, trained, opened, corpus, embedded_cache):
    from moe_scale.inference.generate import render

    run = trained(kind)
    trained_run = opened(kind)
    prompt = " ".join((corpus / "valid.txt").read_text().splitlines()[0].split()[:3])
    prompt_ids = trained_run.tokenizer.encode(prompt)
    max_new = min(5, trained_run.config.data.seq_len - len(prompt_ids))   # a transformer's context holds them
    assert max_new >= 2
    proc = run_cli("generate", "--run", str(run), "--prompt", prompt, "--greedy", "--max-new-tokens", str(max_new),
                   cwd=run.parent, cache=embedded_cache, check=True)
    new, ended = _greedy_rerunning(trained_run.model, prompt_ids, max_new)
    assert new or ended
    assert proc.stdout == render(trained_run.tokenizer, [*prompt_ids, *new]) + ("" if ended else " ...") + "\n"


# ---------------------------------------------------------------- export


def _documented_perplexity_code() -> str:
    blocks = [b for b in code_blocks(section(DOCS, EXPORT_SECTION), "python") if "perplexity per word" in b]
    assert len(blocks) == 1, "docs/using-a-run.md's export section shows the per-word perplexity code once"
    return blocks[0]


def _exported_readme_code(out: Path) -> str:
    (block,) = code_blocks((out / "README.md").read_text(), "python")
    return block


@pytest.mark.parametrize("kind", KINDS)
def test_export(kind, trained, opened, corpus, embedded_cache, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moe_scale.data import Vocab
    from moe_scale.data.eval_windows import EvalWindows

    run = trained(kind)
    out = tmp_path / "exported" / "lstm-moe"   # the name the documented code reads; exported/ does not exist yet
    run_cli("export", "--run", str(run), "--format", "hf", "--out", str(out), cwd=tmp_path, cache=embedded_cache,
            check=True)
    native = kind in NATIVE
    model = AutoModelForCausalLM.from_pretrained(str(out), **({} if native else {"trust_remote_code": True}))
    tokenizer = AutoTokenizer.from_pretrained(str(out), **({} if native else {"trust_remote_code": True}))
    ours = opened(kind)

    if native:
        assert type(model).__name__ == ("Qwen2MoeForCausalLM" if "shared" in kind else "MixtralForCausalLM"
                                        if "moe" in kind else "Qwen3ForCausalLM" if "qk-norm" in kind
                                        else "LlamaForCausalLM")
        assert not list(out.glob("*.py"))
    else:   # every buffer as moe_scale builds it, the saved ones and those transformers builds empty (head masks)
        theirs, mine = dict(model.lm.named_buffers()), dict(ours.model.named_buffers())
        assert theirs.keys() == mine.keys()
        for name, buffer in mine.items():
            assert torch.equal(theirs[name], buffer), name

    # the tokenizer's ids, and the logits on a batch of evaluation windows
    sentences = (corpus / "valid.txt").read_text().splitlines()
    assert tokenizer(sentences[0]).input_ids == [Vocab.BOS_ID, *ours.tokenizer.encode(sentences[0])]
    inputs, _ = next(EvalWindows(sentences, ours.tokenizer, ours.config.data.seq_len, 4).all_windows())
    with torch.no_grad():
        # (a native export's logits are the output layer's; the remote code's already log-probabilities)
        torch.testing.assert_close(model(inputs).logits.log_softmax(-1), ours.model.decode(inputs)[0], atol=1e-5,
                                   rtol=1e-5)

    # the documented per-word perplexity of valid.txt is the run's own validation perplexity
    (tmp_path / "other_text.txt").symlink_to(corpus / "valid.txt")
    printed = run_python(_documented_perplexity_code(), tmp_path).splitlines()[-1]   # a library may log before
    assert printed.startswith("perplexity per word: ")
    assert float(printed.split(":")[1]) == pytest.approx(_summary(run)["valid_ppl"], rel=1e-4)

    # the export's README runs as written, in the export (no prompt; within a transformer's context)
    assert run_python(_exported_readme_code(out), out).splitlines()[-1].startswith(Vocab.BOS)


# ---------------------------------------------------------------- prune-heads


@pytest.mark.parametrize("kind", KINDS)
def test_prune_heads(kind, trained, opened, embedded_cache, tmp_path):
    run = trained(kind)
    args = ["prune-heads", "--run", str(run), "--steps", "3", "--fraction-per-step", "0.25", "--out",
            str(tmp_path / "pruning")]
    proc = run_cli(*args, cwd=tmp_path, cache=embedded_cache)
    if kind not in PRUNABLE:
        what = "an LSTM" if kind.startswith("lstm") else "an MoA"
        assert_one_line_error(proc, f"holds {what} model", "--attention mha or mae")
        assert not (tmp_path / "pruning").exists()
        return
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "pruning" / "pruning.json").read_text())
    steps = report["steps"]
    total = 2 * 4   # 2 layers of 4 heads
    assert [s["heads_pruned"] for s in steps] == [0, 2, 4]
    assert all(len({tuple(h) for h in s["pruned_heads"]}) == s["heads_pruned"] for s in steps)
    assert all(0 <= layer < 2 and 0 <= head < 4 for layer, head in steps[-1]["pruned_heads"])
    assert [s["heads_left"] for s in steps] == [total, total - 2, total - 4]
    assert steps[0]["params"] > steps[1]["params"] > steps[2]["params"]
    assert all(math.isfinite(s["ppl"]) for s in steps)
    assert steps[0]["ppl"] == pytest.approx(_per_token_ppl(opened(kind)), rel=1e-6)


@torch.no_grad()
def _per_token_ppl(trained_run) -> float:
    """Perplexity per token of the unpruned model over the full training-style windows of the validation split
    (what prune-heads reports at its first step), summed here window batch by window batch."""
    from moe_scale.data import LMWindows
    from moe_scale.models.softmax import IGNORE
    from moe_scale.train.data_setup import load_run_splits

    config = trained_run.config
    windows = LMWindows(load_run_splits(config.data)[1], trained_run.tokenizer, seq_len=config.data.seq_len,
                        global_rows=config.train.batch_size, rank=0, world_size=1)
    nll = counted = 0.0
    for inputs, targets in windows.all_windows():
        nll += float(trained_run.model(inputs, targets).nll_sum)
        counted += int((targets != IGNORE).sum())
    return math.exp(nll / counted)
