"""--stream: resume equality (the token sequence after resume equals the uninterrupted one), shuffling,
one pass, rank disjointness, token budget, and the same through the real trainer and its checkpoints."""

from __future__ import annotations

import io
import json
from collections import Counter

import pytest
import torch

from moe_scale.data.stream import StreamBatches
from moe_scale.data.vocab import Vocab
from moe_scale.data.vocab_cache import count_words
from moe_scale.errors import UserError
from tests.cli_runs import TINY, run_train, step_log


def _files(root):
    return sorted((root / "training-monolingual.tokenized.shuffled").iterdir())


def _vocab(files):
    counts, n = count_words(files)
    return Vocab.from_counts(counts, n, max_size=3000)


def _stream(files, vocab, rank=0, world=1, readers=2, buffer=64, rows=4, seq_len=8):
    return StreamBatches(files, vocab, seq_len, rows, rank, world, readers, buffer, seed=5)


def _round_trip(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)


def test_resume_continues_the_exact_token_sequence(lm1b_benchmark):
    files = _files(lm1b_benchmark)
    vocab = _vocab(files)
    straight = _stream(files, vocab)
    expected = [straight.batch(s) for s in range(40)]
    for cut in (1, 17):
        first = _stream(files, vocab)
        before = [first.batch(s) for s in range(cut)]
        state = _round_trip(first.state_dict())
        resumed = _stream(files, vocab)            # a fresh process would build it from scratch
        resumed.load_state_dict(state)
        after = [resumed.batch(s) for s in range(cut, 40)]
        for (x, y), (ex, ey) in zip(before + after, expected):
            assert torch.equal(x, ex) and torch.equal(y, ey)


def test_resume_with_another_layout_is_refused(lm1b_benchmark):
    files = _files(lm1b_benchmark)
    vocab = _vocab(files)
    state = _stream(files, vocab, readers=2).state_dict()
    with pytest.raises(UserError, match="readers_per_rank"):
        _stream(files, vocab, readers=1).load_state_dict(state)


def test_buffer_shuffles_and_one_pass_reads_every_token_once(tmp_path):
    shard = tmp_path / "news.en-00001-of-00100"
    sentences = [f"s{i} w{i % 7}" for i in range(300)]
    shard.write_text("\n".join(sentences) + "\n")
    vocab = Vocab.build(sentences)
    stream = StreamBatches([shard], vocab, 4, 2, 0, 1, 1, 50, seed=1)
    windows = []
    while stream.last_step is None or stream.step <= stream.last_step:
        x, y = stream.batch(stream.step)
        windows += [torch.cat([x[r], y[r, -1:]]) for r in range(x.shape[0])]
    assert stream.last_step == stream.step - 1
    with pytest.raises(RuntimeError, match="ended after step"):
        stream.batch(stream.step)
    # consecutive windows share one token; stitch them back into the token stream
    tokens = windows[0].tolist()
    for w in windows[1:]:
        assert w[0] == tokens[-1]
        tokens += w[1:].tolist()
    firsts = [vocab.words[tokens[i + 1]] for i, t in enumerate(tokens[:-1]) if t == Vocab.BOS_ID]
    read = firsts
    assert len(read) == len(set(read))                                   # no sentence twice
    assert len(read) >= 300 - 2                                          # all but the tail of one window
    assert read != sorted(read, key=lambda s: int(s[1:]))                # shuffled
    # a sentence cannot come out before the buffer has read it: at most buffer-size places early
    assert max(int(s[1:]) - i for i, s in enumerate(read)) <= 50


def test_ranks_read_disjoint_sentences(lm1b_benchmark):
    files = _files(lm1b_benchmark)
    vocab = _vocab(files)
    seen = []
    for rank in range(3):
        stream = _stream(files, vocab, rank=rank, world=3, readers=1, buffer=1, rows=3, seq_len=40)
        tokens = torch.cat([stream.batch(s)[0].reshape(-1) for s in range(30)]).tolist()
        seen.append(Counter(" ".join(vocab.words[t] for t in tokens).split("</S> <S>")[1:-1]))
    for a in range(3):
        for b in range(a + 1, 3):
            common = seen[a] & seen[b]
            assert sum(common.values()) <= 2, common.most_common(3)   # WikiText repeats a few short lines


@pytest.mark.slow   # over 5 s on 2 cores (tests/README.md)
def test_trainer_streaming_resume_equals_an_uninterrupted_run(tmp_path, lm1b_benchmark):
    # also the sampled softmax (its samples come from the per-step seeded RNG) and the factored optimizer
    # (its row/column state goes through DeepSpeed's checkpoint)
    common = [*TINY, "--data", str(lm1b_benchmark), "--vocab-size", "3000", "--stream", "--stream-workers", "2",
              "--shuffle-buffer", "100", "--dropout", "0.1", "--eval-interval", "100", "--checkpoint-interval", "3",
              "--softmax", "sampled", "--num-sampled", "200", "--optimizer", "factored"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    run_train([*common, "--token-budget", str(6 * 8 * 16), "--out", str(straight)], cwd=tmp_path,
              cache=tmp_path / "cache")
    run_train([*common, "--max-steps", "3", "--out", str(split)], cwd=tmp_path, cache=tmp_path / "cache")
    assert (split / "checkpoints" / "step00000003" / "data_stream_rank0.pt").is_file()
    run_train([*common, "--max-steps", "6", "--out", str(split), "--resume"], cwd=tmp_path, cache=tmp_path / "cache")
    expected, resumed = step_log(straight), step_log(split)
    assert [r["step"] for r in expected] == [1, 2, 3, 4, 5, 6]              # the budget: 6 steps of 8 x 16 tokens
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(expected, resumed):
        assert a["loss"] == b["loss"] and a["aux_loss"] == b["aux_loss"], (a, b)
    assert json.loads((straight / "summary.json").read_text())["steps"] == 6
    assert list((tmp_path / "cache" / "vocab").iterdir())                  # counted once, cached


def test_streaming_needs_a_validation_split(tmp_path):
    from moe_scale.config import DataConfig
    from moe_scale.train.data_setup import stream_files
    (tmp_path / "train.txt").write_text("a b c .\n" * 100)
    with pytest.raises(UserError, match="--stream needs a validation split"):
        stream_files(DataConfig(data=str(tmp_path / "train.txt")))


def test_token_budget_needs_stream(tmp_path):
    from tests.cli_runs import assert_one_line_error, run_cli
    proc = run_cli("train", "--token-budget", "1000", "--out", str(tmp_path / "run"), cwd=tmp_path)
    assert_one_line_error(proc, "--token-budget does nothing here: it needs --stream")


@pytest.mark.slow   # over 5 s on 2 cores (tests/README.md)
def test_one_pass_stops_every_rank_after_the_last_full_batch(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.txt").write_text("".join(f"w{i % 13} w{i % 7} w{i % 5} .\n" for i in range(60)))  # 360 tokens
    (data / "valid.txt").write_text("w1 w2 w3 .\n" * 20)
    run = tmp_path / "run"
    args = [*TINY, "--data", str(data), "--stream", "--max-steps", "50", "--eval-interval", "100",
            "--checkpoint-interval", "100", "--out", str(run)]
    proc = run_train(args, cwd=tmp_path, cache=tmp_path / "cache")
    # windows of 17 tokens sharing one: 360 tokens give 22 windows, 8 rows per step: 2 full steps
    assert [r["step"] for r in step_log(run)] == [1, 2]
    assert "the streamed training data ends at step 2" in proc.stdout + proc.stderr
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
    assert json.loads((run / "checkpoints" / "complete").read_text())["step"] == 2
    from tests.cli_runs import assert_one_line_error, run_cli
    summary = (run / "summary.json").read_bytes()
    proc = run_cli("train", *args, "--resume", cwd=tmp_path, cache=tmp_path / "cache")   # nothing left to train
    assert_one_line_error(proc, "has finished (checkpoint step00000002 is after step 2 of 2)",
                          "streamed training data ended there")
    assert [r["step"] for r in step_log(run)] == [1, 2]
    assert (run / "summary.json").read_bytes() == summary
