"""Per-word perplexity the standard way (every word and </S>, never <S>, nothing dropped), by hand on a tiny
model; expert statistics and top tokens; the lm1b held-out convention; corrupt input."""

from __future__ import annotations

import math
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest
import torch

from moe_scale.config import RunConfig
from moe_scale.data.eval_windows import EvalWindows
from moe_scale.data.text import split_files
from moe_scale.data.vocab import Vocab
from moe_scale.errors import UserError
from moe_scale.models.lstm_lm import LSTMMoELM
from moe_scale.models.softmax import IGNORE
from moe_scale.train.evaluate import evaluate
from moe_scale.train.expert_tokens import ExpertTokenStats
from tests.cli_runs import TINY, run_eval, run_train
from tests.cli_runs import assert_one_line_error, run_cli

SENTENCES = ["a b c", "b b", "d a c a zzz", "c"]   # zzz is out of vocabulary


def _vocab() -> Vocab:
    return Vocab.build(["a b c b", "a c d a"])


def test_eval_windows_count_every_word_and_eos_once_and_never_bos():
    vocab = _vocab()
    for seq_len, rows in ((3, 2), (4, 4), (50, 2)):
        windows = EvalWindows(SENTENCES, vocab, seq_len, rows)
        targets = torch.cat([t.reshape(-1) for _, t in windows.all_windows()])
        counted = targets[targets != IGNORE]
        expected = [i for s in SENTENCES for i in vocab.encode(s) + [Vocab.EOS_ID]]
        assert counted.tolist() == expected                      # in order, each once, no <S>
        assert windows.counts == {"words": 11, "sentences": 4, "oov_words": 1, "counted_tokens": 15}


def test_eval_windows_split_over_ranks_equals_one_rank():
    vocab = _vocab()
    one = list(EvalWindows(SENTENCES, vocab, 3, 4).all_windows())
    for world in (2, 4):
        parts = [list(EvalWindows(SENTENCES, vocab, 3, 4, rank=r, world_size=world).all_windows())
                 for r in range(world)]
        assert all(len(p) == len(one) for p in parts)            # every rank runs the same number of batches
        for b, (inputs, targets) in enumerate(one):
            assert torch.equal(torch.cat([p[b][0] for p in parts]), inputs)
            assert torch.equal(torch.cat([p[b][1] for p in parts]), targets)


def test_perplexity_by_hand_on_a_unigram_model():
    """A model whose softmax ignores its input (zero weights) and whose bias is log p: every prediction is
    the unigram p, so the per-word perplexity is exp(-mean log p) over exactly the counted tokens."""
    vocab = _vocab()
    torch.manual_seed(0)
    model = LSTMMoELM(RunConfig.from_settings(d_model=8, expert_hidden=8, num_experts=4, top_k=2), len(vocab))
    p = torch.tensor([0.1, 0.05, 0.2, 0.3, 0.15, 0.12, 0.08])[: len(vocab)]
    p = p / p.sum()
    with torch.no_grad():
        model.softmax.proj.weight.zero_()
        model.softmax.proj.bias.copy_(p.log())
    counted = [i for s in SENTENCES for i in vocab.encode(s) + [Vocab.EOS_ID]]
    by_hand = math.exp(-sum(math.log(p[i]) for i in counted) / len(counted))
    for seq_len in (2, 5):
        result = evaluate(model, EvalWindows(SENTENCES, vocab, seq_len, 2), describe=True)
        assert result["ppl"] == pytest.approx(by_hand, rel=1e-5)
        assert result["tokens"] == 15 and result["words"] == 11 and result["sentences"] == 4
        assert "</S>" in result["counted"] and "<S> is never predicted" in result["counted"]


GATES = {"noisy_topk": ({}, 2), "hierarchical": ({"gate": "hierarchical", "num_groups": 2, "top_k_secondary": 2}, 4)}


def _model(vocab: Vocab, gate: str) -> LSTMMoELM:
    torch.manual_seed(0)
    model = LSTMMoELM(RunConfig.from_settings(d_model=8, expert_hidden=8, num_experts=4, top_k=2, **GATES[gate][0]),
                      len(vocab))
    with torch.no_grad():
        for name, param in model.moe.router.named_parameters():
            if name.startswith("w_gate"):
                param.normal_(0, 1.0)
    return model


@pytest.mark.parametrize("gate", GATES)
def test_expert_token_stats_count_every_real_token_k_times(gate):
    """Flat top-2: 2 pairs per token; hierarchical top-2 of top-2: 4 (its experts are chosen after the exchange,
    beside them: the layer's recorded routes, not a router's output)."""
    vocab = _vocab()
    model = _model(vocab, gate)
    windows = EvalWindows(SENTENCES, vocab, 4, 4)
    stats = ExpertTokenStats(model.moe_layers(), vocab, windows.tokens, top_n=2)
    evaluate(model, windows, observer=stats)
    report = stats.report()["layer0"]
    stats.close()
    assert not model.moe.record_routes and model.moe.routes is None
    inputs, k = len(windows.tokens) - 1, GATES[gate][1]        # every stream token but the last is an input
    assert report["tokens"] == k * inputs                      # k copies, padding excluded
    assert sum(e["load"] for e in report["experts"]) == k * inputs
    assert sum(e["importance"] for e in report["experts"]) == pytest.approx(inputs, rel=1e-5)
    for e in report["experts"]:
        gates = [t["gate"] for t in e["top_by_gate"]]
        assert gates == sorted(gates, reverse=True) and len(gates) == min(2, e["load"])
        assert all(t["context"].endswith("]") for t in e["top_by_gate"])
        assert sum(c for _, c in e["top_words"]) <= e["load"]


def test_oov_rate_is_the_share_of_words_that_became_unk_by_hand():
    """Vocabulary a b c d: in "a x y b" / "<UNK> c q" / "d d" 3 of 9 words are out of it (x, y, q); the text's
    own <UNK> is a word of the vocabulary, not one that became <UNK>."""
    vocab = _vocab()
    text = ["a x y b", "<UNK> c q", "d d"]
    torch.manual_seed(0)
    model = LSTMMoELM(RunConfig.from_settings(d_model=8, expert_hidden=8, num_experts=4, top_k=2), len(vocab))
    result = evaluate(model, EvalWindows(text, vocab, 4, 2), describe=True)
    assert (result["words"], result["oov_words"]) == (9, 3)
    assert result["oov_rate"] == pytest.approx(3 / 9)
    assert evaluate(model, EvalWindows(["a b", "c d a"], vocab, 4, 2), describe=True)["oov_rate"] == 0.0


BALANCE = ("cv_importance", "cv_load", "max_over_mean_load")


@pytest.mark.parametrize("gate", GATES)
def test_padding_leaves_a_pass_balance_alone_and_it_equals_the_expert_stats_block(gate):
    """The 19-token stream in windows of 3 makes 6 windows: batches of 2 or 6 rows hold no padding, batches of 4
    end in two rows of it (windows of 4 end in a padded tail). The pass's balance numbers are the real tokens'
    whatever the padding, the same numbers as eval --expert-stats' per-layer block (one definition)."""
    vocab = _vocab()
    model = _model(vocab, gate)
    results = {}
    for seq_len, rows in ((3, 2), (3, 4), (3, 6), (4, 2)):
        windows = EvalWindows(SENTENCES, vocab, seq_len, rows)
        padded = any(not bool(windows.real_tokens(b).all()) for b in range(windows.num_batches))
        assert padded == ((seq_len, rows) in ((3, 4), (4, 2)))
        stats = ExpertTokenStats(model.moe_layers(), vocab, windows.tokens, top_n=0)
        results[seq_len, rows] = result = evaluate(model, windows, observer=stats)
        block = stats.report()["layer0"]
        stats.close()
        assert {key: result[key] for key in BALANCE} == pytest.approx({key: block[key] for key in BALANCE}, rel=1e-6)
    for rows in (4, 6):
        assert {key: results[3, rows][key] for key in BALANCE} == \
            pytest.approx({key: results[3, 2][key] for key in BALANCE}, rel=1e-6)


def test_lm1b_layout_uses_heldout_shard_00000_for_test(lm1b_benchmark):
    files = split_files(str(lm1b_benchmark))
    assert [f.name for f in files["test"]] == ["news.en.heldout-00000-of-00050"]
    assert [f.name for f in files["valid"]] == ["news.en.heldout-00001-of-00050"]
    assert len(files["train"]) == 5


def test_lm1b_layout_without_heldout_is_an_error(lm1b_benchmark):
    import shutil
    shutil.rmtree(lm1b_benchmark / "heldout-monolingual.tokenized.shuffled")
    with pytest.raises(UserError, match="no held-out split"):
        split_files(str(lm1b_benchmark))


def test_eval_cli_on_the_lm1b_layout_with_expert_stats(tmp_path, lm1b_benchmark):
    run = tmp_path / "run"
    run_train([*TINY, "--data", str(lm1b_benchmark), "--vocab-size", "3000", "--max-steps", "2",
               "--eval-interval", "2", "--out", str(run)], cwd=tmp_path)
    result = run_eval(["--run", str(run), "--split", "test", "--expert-stats", "--top-tokens", "3"], cwd=tmp_path)
    shard = lm1b_benchmark / "heldout-monolingual.tokenized.shuffled" / "news.en.heldout-00000-of-00050"
    lines = [line for line in shard.read_text().splitlines() if line.strip()]
    assert result["source"] == [str(shard)]
    assert result["sentences"] == len(lines)
    assert result["words"] == sum(len(line.split()) for line in lines)
    assert result["tokens"] == result["words"] + result["sentences"]
    known = set((run / "vocab").read_text().splitlines())                  # a hand count of the OOV words
    words = [w for line in lines for w in line.split()]
    assert result["oov_rate"] == pytest.approx(sum(w not in known for w in words) / len(words))
    assert 0 < result["oov_rate"] < 1
    layer = result["expert_stats"]["layer0"]
    assert len(layer["experts"]) == 8 and all(len(e["top_by_gate"]) == 3 for e in layer["experts"] if e["load"] >= 3)
    assert layer["tokens"] == 2 * (result["words"] + 2 * result["sentences"] - 1)   # inputs incl. <S>, x k


def test_non_utf8_shard_is_one_clear_error(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("the cat sat .\n" * 200)
    (data / "b.txt").write_bytes(b"the dog \xff\xfe ran .\n" * 10)
    proc = run_cli("train", "--data", str(data), "--out", str(tmp_path / "run"), "--max-steps", "1", cwd=tmp_path)
    assert_one_line_error(proc, "b.txt", "not UTF-8", "offset 8")
    assert not (tmp_path / "run").exists()


def test_empty_shard_is_a_logged_skip(tmp_path, monkeypatch, capsys):
    from moe_scale.data.text import load_sentences
    monkeypatch.setenv("MOE_SCALE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "a.txt").write_text("one two\nthree\n")
    (tmp_path / "b.txt").write_text("\n  \n")
    assert len(load_sentences([tmp_path / "a.txt", tmp_path / "b.txt"])) == 2
    assert f"moe-scale: skipping empty shard {tmp_path / 'b.txt'}" in capsys.readouterr().err


def test_hierarchical_expert_stats_on_several_processes_is_one_line():
    from moe_scale.commands.eval import check_expert_stats_world

    hierarchical = RunConfig.from_settings(num_experts=4, top_k=2, **GATES["hierarchical"][0])
    check_expert_stats_world(hierarchical, 1)
    check_expert_stats_world(RunConfig.from_settings(num_experts=4, top_k=2), 2)     # flat pairs are the rank's own
    with pytest.raises(UserError, match=r"hierarchical gate runs in one process .* this launch has 2\): start eval "
                                        r"without a launcher"):
        check_expert_stats_world(hierarchical, 2)
