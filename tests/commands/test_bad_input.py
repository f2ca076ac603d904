"""The bad-input table: each case is a user's mistake (paths, data, flags, configs, damaged runs) and must end in
exit status 2, exactly one `moe-scale: error:` line naming the problem (checked by its fragments), no traceback,
and every file under the working directory as it was: a refused train creates no --out, a refused resume or eval
changes nothing in the run. The runs the cases damage are copies of the session's shared runs (conftest.py)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
from pathlib import Path
from typing import Callable

import pytest

from moe_scale.train.run_lock import LOCK_NAME, _process_start
from tests.cli_runs import FAST, assert_one_line_error, run_cli

NEW, OLD = "step00000004", "step00000002"
NO_RUN = ["--run", "missing: no trained run there", "pass the --out directory of a finished `moe-scale train`"]
LINES = "the cat sat on the mat .\n" * 400


class Work:
    """The case's working directory: text files, JSON files and copies of the trained runs, made on demand."""

    def __init__(self, root: Path, trained: Path, trained_transformer: Path | None = None):
        self.root, self._trained, self._transformer = root, trained, trained_transformer

    def text(self, name: str, content: str | bytes = LINES) -> str:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return str(path)

    def folder(self, name: str, *files: str) -> str:
        for f in files:
            self.text(f"{name}/{f}")
        return str(self.root / name)

    def run(self, edit: Callable[[Path], None] | None = None) -> str:
        run = self.root / "run"
        shutil.copytree(self._trained, run)
        if edit:
            edit(run)
        return str(run)

    def transformer_run(self) -> str:
        run = self.root / "transformer_run"
        shutil.copytree(self._transformer, run)
        return str(run)

    def out(self) -> str:
        return str(self.root / "new_run")


def _edit_config(section: str, key: str, value) -> Callable[[Path], None]:
    def edit(run: Path) -> None:
        config = json.loads((run / "config.json").read_text())
        config[section][key] = value
        (run / "config.json").write_text(json.dumps(config))
    return edit


def _damage(how: str) -> Callable[[Path], None]:
    def edit(run: Path) -> None:
        victim = max((run / "checkpoints" / NEW).rglob("*.pt"), key=lambda p: p.stat().st_size)
        data = bytearray(victim.read_bytes())
        if how == "truncate":
            victim.write_bytes(data[: len(data) // 2])
        elif how == "empty":
            victim.write_bytes(b"")
        elif how == "flip64":
            data[len(data) // 2: len(data) // 2 + 64] = bytes(
                b ^ 0xFF for b in data[len(data) // 2: len(data) // 2 + 64])
            victim.write_bytes(bytes(data))
        else:
            victim.unlink()
    return edit


def _live_lock(run: Path) -> None:   # this test process holds it: alive, on this host
    pid = os.getpid()
    (run / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": pid, "start": _process_start(pid)}))


def _ds(w: Work, content: str) -> list[str]:
    return ["train", "--data", w.text("corpus.txt"), "--ds-config", w.text("ds.json", content), "--out", w.out(),
            *FAST]


CASES = [
    # data
    ("data-missing", lambda w: ["train", "--data", str(w.root / "nope.txt"), "--out", w.out(), *FAST],
     ["--data", "nope.txt", "no such file"]),
    ("data-blank", lambda w: ["train", "--data", str(Path(w.text("d/a.txt", "\n\n  \n")).parent), "--out", w.out(),
                              *FAST], ["empty"]),
    ("data-not-utf8", lambda w: ["train", "--data", w.text("b.txt", b"ok .\n\xff\xfe abc\n"), "--out", w.out(), *FAST],
     ["b.txt", "not UTF-8", "offset 5"]),
    ("data-fifo", lambda w: ["train", "--data", _fifo(w.root / "pipe.txt"), "--out", w.out(), *FAST],
     ["pipe.txt is a named pipe (FIFO), not a regular file", "save the text to a file"]),
    ("data-fifo-split", lambda w: ["train", "--data", str(Path(_fifo(w.root / "c" / "train.txt")).parent), "--out",
                                   w.out(), *FAST], ["train.txt is a named pipe (FIFO)"]),
    ("data-unreadable", lambda w: ["train", "--data", str(_link(w.root / "c.txt", "/proc/self/mem")), "--out",
                                   w.out(), *FAST], ["c.txt", "cannot be read"]),
    ("data-heldout-without-train", lambda w: ["train", "--data", w.folder("h", "valid.txt", "test.txt"), "--out",
                                              w.out(), *FAST],
     ["held-out files", "no training files", "kjv.train.txt"]),
    ("data-split-beside-unnamed", lambda w: ["train", "--data", w.folder("m", "train.txt", "notes.txt"), "--out",
                                             w.out(), *FAST], ["notes.txt", "split rule"]),
    ("data-too-small-for-batch", lambda w: ["train", "--data", w.text("t.txt", "a b c .\n" * 3), "--valid-data",
                                            w.text("v.txt", "a b .\n"), "--test-data", w.text("e.txt", "a c .\n"),
                                            "--out", w.out(), "--batch-size", "64", "--seq-len", "32"],
     ["--batch-size"]),
    # flags
    ("moa-without-transformer", lambda w: ["train", "--attention", "moa", "--out", w.out(), *FAST],
     ["--attention", "--model transformer"]),
    ("top-k-above-experts", lambda w: ["train", "--num-experts", "4", "--top-k", "5", "--out", w.out(), *FAST],
     ["--top-k 5", "--num-experts 4"]),
    ("w-load-huge", lambda w: ["train", "--w-load", "1e30", "--out", w.out(), *FAST],
     ["--w-load 1e+30 is outside [0, 10]", "outweighs the language-model loss"]),
    ("moa-aux-weight-negative", lambda w: ["train", "--model", "transformer", "--attention", "moa",
                                           "--moa-aux-weight", "-1", "--out", w.out(), *FAST],
     ["--moa-aux-weight -1 is outside [0, 10]"]),
    ("bias-update-rate-negative", lambda w: ["train", "--gate", "aux_free", "--bias-update-rate", "-0.001", "--out",
                                             w.out(), *FAST], ["--bias-update-rate -0.001 is outside [0, 1]"]),
    ("aux-free-sigmoid-top-1", lambda w: ["train", "--gate", "aux_free", "--top-k", "1", "--out", w.out(), *FAST],
     ["--gate aux_free with --top-k 1 and sigmoid scores", "--aux-free-score softmax"]),
    ("bias-update-rate-without-aux-free", lambda w: ["train", "--bias-update-rate", "0.01", "--out", w.out(), *FAST],
     ["--bias-update-rate does nothing here", "--gate aux_free"]),
    ("shared-expert-gate-without-shared-experts", lambda w: ["train", "--shared-expert-gate", "--out", w.out(),
                                                             *FAST],
     ["--shared-expert-gate does nothing here", "--shared-experts 1 or more"]),
    ("w-importance-inf", lambda w: ["train", "--w-importance", "inf", "--out", w.out(), *FAST],
     ["--w-importance inf", "finite"]),
    ("lr-nan", lambda w: ["train", "--lr", "nan", "--out", w.out(), *FAST], ["--lr nan", "finite"]),
    ("capacity-factor-zero", lambda w: ["train", "--dispatch", "capacity", "--capacity-factor", "0", "--out",
                                        w.out(), *FAST], ["--capacity-factor must be positive"]),
    ("node-size-negative", lambda w: ["train", "--node-size", "-2", "--out", w.out(), *FAST], ["--node-size"]),
    ("experts-not-divisible-by-ep", lambda w: ["train", "--num-experts", "6", "--ep-size", "4", "--out", w.out(),
                                               *FAST], ["not divisible by --ep-size"]),
    ("ep-size-above-processes", lambda w: ["train", "--ep-size", "2", "--out", w.out(), *FAST],
     ["does not divide the 1 processes"]),
    ("etp-above-processes", lambda w: ["train", "--etp-size", "2", "--out", w.out(), *FAST],
     ["--ep-size 1 x --etp-size 2 = 2 does not divide the 1 processes"]),
    ("etp-not-dividing-hidden", lambda w: ["train", "--etp-size", "3", "--expert-hidden", "16", "--out", w.out(),
                                           *FAST], ["--etp-size 3 does not divide --expert-hidden 16"]),
    ("etp-moa", lambda w: ["train", "--model", "transformer", "--ffn", "moe", "--attention", "moa", "--etp-size",
                           "2", "--out", w.out(), *FAST], ["--etp-size does nothing here", "without --attention moa"]),
    ("a2a-chunks-zero", lambda w: ["train", "--a2a-chunks", "0", "--out", w.out(), *FAST], ["--a2a-chunks must be"]),
    ("mae-epochs-while-streaming", lambda w: ["train", "--model", "transformer", "--attention", "mae", "--stream",
                                              "--out", w.out(), *FAST], ["--mae-g-unit epoch needs epochs"]),
    ("tokenizer-missing", lambda w: ["train", "--tokenizer", str(w.root / "tok.json"), "--out", w.out(), *FAST],
     ["--tokenizer", "tok.json", "no such file"]),
    ("tokenizer-wordlevel-without-its-unk", lambda w: ["train", "--tokenizer", w.text("tok.json", _tokenizer(
        "wordlevel-no-unk")), "--out", w.out(), *FAST], ["cannot encode the training text", "Missing [UNK]"]),
    ("tokenizer-empty-bpe", lambda w: ["train", "--tokenizer", w.text("tok.json", _tokenizer("empty-bpe")),
                                       "--out", w.out(), *FAST], ["0.00 tokens per word", "at least 0.5"]),
    ("tokenizer-drops-characters", lambda w: ["train", "--tokenizer", w.text("tok.json", _tokenizer("char-bpe")),
                                              "--out", w.out(), *FAST], ["has no token for", "no unknown token"]),
    ("tokenizer-not-json", lambda w: ["train", "--tokenizer", w.text("tok.json", "merges: a b"), "--out", w.out(),
                                      *FAST], ["--tokenizer", "not a tokenizer.json"]),
    ("bpe-vocab-below-bytes", lambda w: ["train", "--tokenizer", "bpe", "--vocab-size", "100", "--out", w.out(),
                                         *FAST], ["--vocab-size of at least 260"]),
    ("bpe-unigram-sampler", lambda w: ["train", "--tokenizer", "bpe", "--vocab-size", "300", "--softmax", "sampled",
                                       "--sampler", "unigram", "--num-sampled", "50", "--out", w.out(), *FAST],
     ["--sampler unigram", "--tokenizer words"]),
    ("checkpoint-interval-negative", lambda w: ["train", "--checkpoint-interval", "-1", "--out", w.out(), *FAST],
     ["--checkpoint-interval must be 0 (never) or positive"]),
    ("model-too-large", lambda w: ["train", "--d-model", "8192", "--expert-hidden", "16384", "--num-experts",
                                   "4096", "--out", w.out(), *FAST], ["cannot fit", "expert parameters", "GiB"]),
    # DeepSpeed JSON
    ("ds-not-json", lambda w: _ds(w, '{"gradient_clipping": 1.0,'), ["not valid JSON"]),
    ("ds-top-level-typo", lambda w: _ds(w, '{"zero_optimisation": {"stage": 2}}'),
     ["did you mean 'zero_optimization'"]),
    ("ds-own-optimizer", lambda w: _ds(w, '{"optimizer": {"type": "Adam"}}'), ["remove 'optimizer'"]),
    ("ds-not-an-object", lambda w: _ds(w, "[1, 2]"), ["JSON object"]),
    ("ds-batch-size", lambda w: _ds(w, '{"train_batch_size": 7}'), ["train_batch_size"]),
    ("ds-nested-value", lambda w: _ds(w, '{"zero_optimization": {"stage": 2, "overlap_comm": "maybe"}}'),
     ["'zero_optimization.overlap_comm'"]),
    ("ds-nested-typo", lambda w: _ds(w, '{"zero_optimization": {"stagee": 2}}'), ["'zero_optimization.stagee'"]),
    ("ds-stage-true", lambda w: _ds(w, '{"zero_optimization": {"stage": true}}'), ["stage must be 0, 1 or 2"]),
    ("ds-stage-3-with-moe", lambda w: _ds(w, '{"zero_optimization": {"stage": 3}}'), ["stage 3", "stage 2"]),
    ("ds-clipping-text", lambda w: _ds(w, '{"gradient_clipping": "abc"}'), ["gradient_clipping must be a number"]),
    ("ds-fp16-on-cpu", lambda w: _ds(w, '{"fp16": {"enabled": true}}'), ["fp16 needs a GPU"]),
    # run configuration files
    ("config-unknown-key", lambda w: ["train", "--config", w.text("c.json", '{"model": {"num_expert": 4}}'),
                                      "--out", w.out(), *FAST], ["unknown key(s) ['num_expert']"]),
    ("config-unknown-section", lambda w: ["train", "--config", w.text("c.json", '{"modle": {}}'), "--out", w.out(),
                                          *FAST], ["unknown section(s) ['modle']"]),
    ("config-not-json", lambda w: ["train", "--config", w.text("c.json", '{"model": '), "--out", w.out(), *FAST],
     ["not valid JSON"]),
    # --out
    ("out-empty", lambda w: ["train", "--out", "", *FAST], ["--out is empty"]),
    ("out-under-a-file", lambda w: ["train", "--out", str(Path(w.text("a_file")) / "run"), *FAST],
     ["--out", "a_file is a file, not a directory"]),
    ("out-dangling-link", lambda w: ["train", "--out", str(_link(w.root / "gone", str(w.root / "nowhere"))), *FAST],
     ["symbolic link", "nowhere, which does not exist"]),
    ("out-in-proc", lambda w: ["train", "--out", "/proc/moe_scale_run", *FAST], ["--out"]),
    ("overwrite-not-a-run", lambda w: ["train", "--overwrite", "--out", str(Path(w.text("d/mine.txt")).parent),
                                       *FAST], ["does not hold a moe_scale run"]),
    ("out-holds-a-run", lambda w: ["train", "--out", w.run(), *FAST], ["already holds a run", "--resume"]),
    ("out-live-lock", lambda w: ["train", "--resume", "--max-steps", "6", "--out", w.run(_live_lock)],
     ["in use by a live run", str(os.getpid())]),
    # resume
    ("resume-nothing", lambda w: ["train", "--resume", "--out", w.out()], ["no run to resume"]),
    ("resume-other-lr-and-seed", lambda w: ["train", "--resume", "--lr", "0.1", "--seed", "99", "--out", w.run()],
     ["--lr 0.1", "trained with --lr", "--max-steps"]),
    ("resume-other-experts", lambda w: ["train", "--resume", "--num-experts", "4", "--out", w.run()],
     ["--num-experts 4", "trained with --num-experts 8"]),
    ("resume-a-finished-run", lambda w: ["train", "--resume", "--out", w.run()],
     ["has finished (checkpoint step00000004 is after step 4 of 4)", "nothing to train", "larger --max-steps"]),
    ("resume-on-changed-data", lambda w: ["train", "--resume", "--max-steps", "6", "--out", w.run(_other_data)],
     ["the training data changed since this run started", "train file", "--accept-changed-data"]),
    ("accept-changed-data-without-resume", lambda w: ["train", "--accept-changed-data", "--out", w.out(), *FAST],
     ["--accept-changed-data does nothing here: it needs --resume"]),
    ("upcycle-no-run", lambda w: ["train", "--upcycle-from", str(w.root / "missing"), "--out", w.out(), *FAST],
     ["--upcycle-from", "no trained run there"]),
    ("upcycle-from-an-moe-run", lambda w: ["train", "--upcycle-from", w.run(), "--out", w.out(), *FAST],
     ["it is a --layout lstm-moe-lstm run", "--layout lstm-ffn-lstm --ffn-layers 1"]),
    ("upcycle-other-width", lambda w: ["train", "--upcycle-from", w.run(_dense), "--d-model", "48", "--expert-hidden",
                                       "32", "--out", w.out(), *FAST],
     ["trained with --d-model 32, this run asks for 48", "pass --d-model 32"]),
    ("upcycle-other-expert-width", lambda w: ["train", "--upcycle-from", w.run(_dense), "--out", w.out(), *FAST],
     ["its FFN is --expert-hidden 32 wide, this run asks for 128", "pass --expert-hidden 32"]),
    ("upcycle-into-another-expert-kind", lambda w: ["train", "--upcycle-from", w.run(_dense), "--expert-hidden", "32",
                                                    "--expert-kind", "geglu", "--out", w.out(), *FAST],
     ["its dense FFN is relu", "--expert-kind geglu", "pass --expert-kind relu"]),
    ("upcycle-from-a-live-run", lambda w: ["train", "--upcycle-from", w.run(lambda r: (_dense(r), _live_lock(r))),
                                           "--expert-hidden", "32", "--out", w.out(), *FAST],
     ["--upcycle-from", "the run is still training", "from a copy of one of its checkpoints"]),
    ("upcycle-into-itself", lambda w: ["train", "--upcycle-from", w.run(_dense), "--expert-hidden", "32",
                                       "--overwrite", "--out", str(w.root / "run"), *FAST],
     ["it is this run's --out too", "pass another --out"]),
    ("llama-relu-experts", lambda w: ["train", "--model", "transformer", "--block", "llama", "--ffn", "moe",
                                      "--expert-kind", "relu", "--out", w.out(), *FAST],
     ["--expert-kind relu", "the llama block's experts are gated", "pass --expert-kind swiglu or geglu"]),
    ("upcycle-lstm-into-a-transformer", lambda w: ["train", "--model", "transformer", "--ffn", "moe",
                                                   "--upcycle-from", w.run(_dense), "--out", w.out(), *FAST],
     ["it is a --model lstm run, this one --model transformer"]),
    ("upcycle-default-transformer-block", lambda w: ["train", "--model", "transformer", "--ffn", "moe",
                                                     "--upcycle-from", w.transformer_run(), "--out", w.out(), *FAST],
     ["default transformer block's dense FFN", "--block llama"]),
    ("llama-shared-experts-without-gate", lambda w: ["train", "--model", "transformer", "--block", "llama",
                                                     "--ffn", "moe", "--shared-experts", "1", "--out", w.out(),
                                                     *FAST],
     ["--shared-experts 1", "Qwen2-MoE's", "add --shared-expert-gate"]),
    ("upcycle-noise-alone", lambda w: ["train", "--upcycle-noise", "0.01", "--out", w.out(), *FAST],
     ["--upcycle-noise does nothing here: it needs --upcycle-from RUN"]),
    ("resume-from-without-resume", lambda w: ["train", "--resume-from", OLD, "--out", w.run()],
     ["--resume-from", "--resume"]),
    ("resume-from-unknown-tag", lambda w: ["train", "--resume", "--resume-from", "step00000099", "--out", w.run()],
     ["no checkpoint step00000099", f"--resume-from {NEW}"]),
    ("resume-config-dropout-text", lambda w: ["train", "--resume", "--out", w.run(_edit_config("model", "dropout",
                                                                                               "abc"))],
     ["'model.dropout' must be float", "config.json"]),
    ("resume-garbage-marker", lambda w: ["train", "--resume", "--out", w.run(
        lambda r: (r / "checkpoints" / "complete").write_text("garbage"))], ["complete is unreadable", NEW]),
    ("resume-empty-checkpoint-file", lambda w: ["train", "--resume", "--out", w.run(_damage("empty"))],
     ["has 0 bytes", f"--resume-from {OLD}"]),
    # eval and prune-heads
    ("eval-no-run", lambda w: ["eval", "--run", str(w.root / "missing")], NO_RUN),
    ("eval-config-dropout-null", lambda w: ["eval", "--run", w.run(_edit_config("model", "dropout", None))],
     ["'model.dropout' must be float"]),
    ("eval-config-other-d-model", lambda w: ["eval", "--run", w.run(_edit_config("model", "d_model", 48))],
     ["trained with --d-model 32", "48"]),
    ("eval-truncated-checkpoint", lambda w: ["eval", "--run", w.run(_damage("truncate"))],
     ["cut short", f"--checkpoint {OLD}"]),
    ("eval-missing-checkpoint-file", lambda w: ["eval", "--run", w.run(_damage("delete"))],
     ["missing", f"--checkpoint {OLD}"]),
    ("eval-64-flipped-bytes", lambda w: ["eval", "--run", w.run(_damage("flip64"))],
     ["checksum", f"--checkpoint {OLD}"]),
    ("eval-unknown-checkpoint", lambda w: ["eval", "--run", w.run(), "--checkpoint", "nope"], ["nope"]),
    ("prune-lstm-run", lambda w: ["prune-heads", "--run", w.run()], ["holds an LSTM model", "transformer"]),
    ("prune-no-run", lambda w: ["prune-heads", "--run", str(w.root / "missing")], NO_RUN),
    # export
    ("export-target-exists", lambda w: ["export", "--run", w.run(), "--out", str(Path(w.text("x/keep.txt")).parent)],
     ["--out", "already exists"]),
    ("export-target-inside-a-file", lambda w: ["export", "--run", w.run(), "--out", w.text("f.txt") + "/a/hf"],
     ["f.txt is not a directory", "inside a directory"]),
    ("export-no-run", lambda w: ["export", "--run", str(w.root / "missing"), "--out", str(w.root / "hf")], NO_RUN),
    ("export-no-run-parents-missing", lambda w: ["export", "--run", str(w.root / "missing"), "--out",
                                                str(w.root / "no" / "hf")], NO_RUN),   # and no/ is not created
    # generate
    ("generate-no-run", lambda w: ["generate", "--run", str(w.root / "missing")], NO_RUN),
    ("generate-no-checkpoint", lambda w: ["generate", "--run", w.run(
        lambda r: [shutil.rmtree(p) if p.is_dir() else p.unlink() for p in (r / "checkpoints").iterdir()])],
     ["no complete checkpoint"]),
    ("generate-temperature-zero", lambda w: ["generate", "--run", w.run(), "--temperature", "0"],
     ["--temperature must be positive", "--greedy"]),
    ("generate-top-p-above-one", lambda w: ["generate", "--run", w.run(), "--top-p", "1.5"], ["--top-p", "(0, 1]"]),
    ("generate-no-words", lambda w: ["generate", "--run", w.run(), "--max-new-tokens", "0"], ["--max-new-tokens"]),
    ("generate-prompt-file-missing", lambda w: ["generate", "--run", w.run(), "--prompt-file", "nope.txt"],
     ["--prompt-file nope.txt", "no such file"]),
    ("generate-prompt-beyond-context", lambda w: ["generate", "--run", w.transformer_run(), "--prompt",
                                                  " ".join(["the"] * 20)], ["longer than the model's context of 16"]),
    ("generate-words-beyond-context", lambda w: ["generate", "--run", w.transformer_run(), "--prompt", "a b c",
                                                 "--max-new-tokens", "30"], ["--max-new-tokens 13 or less"]),
]


def _dense(run: Path) -> None:
    """The run's config as a dense one's (--layout lstm-ffn-lstm --ffn-layers 1): checked before its weights."""
    config = json.loads((run / "config.json").read_text())
    config["model"]["lstm"].update(layout="lstm-ffn-lstm", ffn_layers=1)
    (run / "config.json").write_text(json.dumps(config))


def _fifo(path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    return str(path)


def _other_data(run: Path) -> None:
    """As if the training file had been replaced after the run started: the run's record says other bytes."""
    record = json.loads((run / "data_files.json").read_text())
    record["splits"]["train"][0]["bytes"] += 1
    (run / "data_files.json").write_text(json.dumps(record))


def _tokenizer(kind: str) -> str:
    """A tokenizer.json a user might bring: a WordLevel whose unknown token is missing from its vocabulary, a BPE
    with no merges or vocabulary, a character BPE without an unknown token."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    if kind == "wordlevel-no-unk":
        tokenizer = Tokenizer(models.WordLevel({"the": 0, "cat": 1}, unk_token="[UNK]"))
    elif kind == "empty-bpe":
        tokenizer = Tokenizer(models.BPE())
    else:
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
        tokenizer.train_from_iterator(LINES.splitlines(), trainers.BpeTrainer(vocab_size=40, show_progress=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer.to_str()


def _link(path: Path, target: str) -> Path:
    path.symlink_to(target)
    return path


def _snapshot(root: Path) -> dict[str, str]:
    """Every path under root with its content hash (links: their target), directories included."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "-> " + os.readlink(p)
            elif p.is_dir():
                out[rel] = "dir"
            elif not p.is_file():   # a FIFO: reading it would wait for a writer
                out[rel] = "special"
            else:
                out[rel] = hashlib.sha1(p.read_bytes()).hexdigest()
    return out


@pytest.mark.parametrize("make_args, fragments", [pytest.param(m, f, id=i) for i, m, f in CASES])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, lstm_run, moa_moe_run, embedded_cache, make_args,
                                                         fragments):
    args = make_args(Work(tmp_path, lstm_run, moa_moe_run))
    before = _snapshot(tmp_path)
    proc = run_cli(*args, cwd=tmp_path, cache=embedded_cache)
    assert_one_line_error(proc, *fragments)
    assert _snapshot(tmp_path) == before

