import threading

import numpy as np
import pytest
import torch
from datasets import Dataset

from moe_scale.data.batches import LMWindows, row_bounds
from moe_scale.data.text import load_sentences, split_files
from moe_scale.data.vocab import Vocab
from moe_scale.errors import UserError
from tests.wikitext import wikitext_text


def _dataset(n=60, seed=0):
    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(30)]
    return Dataset.from_dict({"text": [" ".join(rng.choice(words, size=rng.integers(1, 12))) for _ in range(n)]})


def _ranks(ds, vocab, world_size, **kw):
    """Build all ranks' LMWindows in threads, with a real all-reduce MIN across them (a barrier)."""
    seen, out = [None] * world_size, [None] * world_size
    barrier = threading.Barrier(world_size)

    def min_over_ranks(rank):
        def reduce(n):
            seen[rank] = n
            barrier.wait()
            return min(seen)
        return reduce

    def build(rank):
        try:
            out[rank] = LMWindows(ds, vocab, rank=rank, world_size=world_size,
                                  min_over_ranks=min_over_ranks(rank), **kw)
        except Exception as e:  # noqa: BLE001 - handed back to the test thread
            out[rank] = e

    threads = [threading.Thread(target=build, args=(r,)) for r in range(world_size)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    for r in out:
        if isinstance(r, Exception):
            raise r
    return out


@pytest.mark.parametrize("shuffle_seed", [None, 7])
def test_world_size_independent(shuffle_seed):
    ds = _dataset()
    vocab = Vocab.build(ds["text"])
    (one,) = _ranks(ds, vocab, 1, seq_len=5, global_rows=4)
    two = _ranks(ds, vocab, 2, seq_len=5, global_rows=4)
    four = _ranks(ds, vocab, 4, seq_len=5, global_rows=4)
    assert one.num_windows == two[0].num_windows == two[1].num_windows == four[3].num_windows >= 3
    for step in range(3 * one.num_windows + 1):  # crosses epoch boundaries
        x, y = one.batch(step, shuffle_seed)
        assert x.shape == y.shape == (4, 5) and x.dtype == y.dtype == torch.int64
        for parts in (two, four):
            xs, ys = zip(*(r.batch(step, shuffle_seed) for r in parts))
            assert torch.equal(torch.cat(xs), x) and torch.equal(torch.cat(ys), y)


def test_shuffling_is_per_epoch_and_deterministic():
    ds = _dataset(n=200)
    (w,) = _ranks(ds, Vocab.build(ds["text"]), 1, seq_len=3, global_rows=2)
    W = w.num_windows
    order = lambda epoch, seed: [w.window_index(epoch * W + i, seed) for i in range(W)]  # noqa: E731
    assert order(0, None) == list(range(W))
    assert sorted(order(0, 1)) == list(range(W)) and order(0, 1) != order(1, 1)
    assert order(1, 1) == order(1, 1) and order(0, 1) != order(0, 2)
    assert torch.equal(w.batch(W + 3, 1)[0], w.batch(W + 3, 1)[0])


def test_rows_targets_and_coverage():
    ds = _dataset(n=40)
    vocab = Vocab.build(ds["text"])
    (w,) = _ranks(ds, vocab, 1, seq_len=4, global_rows=2)
    bounds = row_bounds(ds, 2)
    assert 0 < bounds[1] < 40 and bounds[2] == 40
    for i in range(2):  # row i = contiguous run i of sentences, each sentence as <S> ids </S>
        shard = ds["text"][bounds[i]:bounds[i + 1]]
        expected = [t for s in shard for t in [Vocab.BOS_ID] + vocab.encode(s) + [Vocab.EOS_ID]]
        assert w.rows[i].tolist() == expected and w.rows[i].dtype == np.int32
    wins = list(w.all_windows())
    assert len(wins) == w.num_windows == (min(len(r) for r in w.rows) - 1) // 4
    for x, y in wins:
        assert torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one
    # consecutive windows tile each row: inputs cover tokens [0, W*T), targets [1, W*T]
    xs = torch.cat([x for x, _ in wins], dim=1)
    ys = torch.cat([y for _, y in wins], dim=1)
    for i, row in enumerate(w.rows):
        n = w.num_windows * 4
        assert xs[i].tolist() == row[:n].tolist() and ys[i].tolist() == row[1:n + 1].tolist()


def test_too_small_data_is_a_user_error():
    ds = Dataset.from_dict({"text": ["a b c", "d e"]})
    vocab = Vocab.build(ds["text"])
    with pytest.raises(UserError, match="smaller --batch-size or --seq-len") as e:
        _ranks(ds, vocab, 2, seq_len=8, global_rows=2)
    assert "9 tokens" in str(e.value)
    with pytest.raises(UserError, match="too small"):  # fewer sentences than rows: some rows are empty
        LMWindows(ds, vocab, seq_len=1, global_rows=4)
    with pytest.raises(UserError, match="multiple of 2"):
        LMWindows(ds, vocab, seq_len=1, global_rows=3, world_size=2)


def test_lm1b_shards_end_to_end(lm1b_shards, tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_SCALE_CACHE", str(tmp_path / "cache"))
    files = split_files(str(lm1b_shards))
    train = load_sentences(files["train"])
    vocab = Vocab.build(train["text"], max_size=5000)
    (one,) = _ranks(train, vocab, 1, seq_len=32, global_rows=8)
    two = _ranks(train, vocab, 2, seq_len=32, global_rows=8)
    assert one.num_windows > 500
    for step in [0, 1, one.num_windows - 1, one.num_windows, 5 * one.num_windows + 3]:
        x, y = one.batch(step, shuffle_seed=3)
        assert torch.equal(torch.cat([r.batch(step, 3)[0] for r in two]), x)
        assert 0 <= int(x.min()) and int(x.max()) < len(vocab)
    test = LMWindows(load_sentences(files["test"]), vocab, seq_len=32, global_rows=8, what="the test data")
    assert sum(1 for _ in test.all_windows()) == test.num_windows > 0


def _row_bounds_reference(texts, rows):
    """A loop: each sentence goes to the row holding its middle token (tokens = words + <S> + </S>)."""
    lengths = [len(t.split()) + 2 for t in texts]
    total, position, row_of = sum(lengths), 0, []
    for n in lengths:
        row_of.append(min(int((position + n / 2) * rows // total), rows - 1))
        position += n
    return [sum(1 for r in row_of if r < i) for i in range(rows + 1)]


@pytest.mark.parametrize("rows", [1, 2, 7, 32, 100])
def test_row_bounds_balance_tokens_not_lines(rows):
    """Paragraph-sized lines of very different lengths: rows cut by the running token count agree with the
    reference loop, cover every sentence once in order, and differ from total/R by less than one sentence."""
    rng = np.random.default_rng(rows)
    texts = [" ".join(["w"] * int(n)) for n in rng.choice([1, 3, 40, 400], size=300, p=[.4, .3, .2, .1])]
    ds = Dataset.from_dict({"text": texts})
    bounds = row_bounds(ds, rows, batch_size=64)   # several Arrow pieces
    assert bounds.tolist() == _row_bounds_reference(texts, rows)
    # the same text with its words separated by every kind of whitespace str.split() knows, and runs of it
    spaces = [chr(c) for c in range(0x110000) if chr(c).isspace()]
    rng_spaces = np.random.default_rng(0)
    odd = [t.replace(" ", "".join(rng_spaces.choice(spaces, size=rng_spaces.integers(1, 4)))) for t in texts]
    odd_ds = Dataset.from_dict({"text": odd[:64] + texts[64:]})   # one Arrow piece irregular, the rest single-spaced
    assert row_bounds(odd_ds, rows, batch_size=64).tolist() == bounds.tolist()
    assert row_bounds(ds.select(range(299, -1, -1)), rows).tolist() == _row_bounds_reference(texts[::-1], rows)
    tokens = np.array([len(t.split()) + 2 for t in texts])
    per_row = np.array([tokens[bounds[i]:bounds[i + 1]].sum() for i in range(rows)])
    assert per_row.sum() == tokens.sum() and (np.diff(bounds) >= 0).all()
    assert np.abs(per_row - tokens.sum() / rows).max() < tokens.max()
    assert row_bounds(Dataset.from_dict({"text": []}), 3).tolist() == [0, 0, 0, 0]


def test_an_epoch_covers_almost_all_of_wikitext():
    """WikiText-2's validation split, one paragraph per line (lines of 3 to 700 words), 32 rows x 32 tokens:
    rows of equal line counts covered 55% of it per epoch; rows balanced by tokens cover over 95%."""
    lines = [line.strip() for line in wikitext_text("valid").splitlines() if line.strip()]
    ds = Dataset.from_dict({"text": lines})
    windows = LMWindows(ds, Vocab.build(lines, max_size=5000), seq_len=32, global_rows=32)
    assert windows.epoch_share > 0.95
    assert sum(len(r) for r in windows.rows) == sum(len(t.split()) + 2 for t in lines)


def test_describe_says_how_much_of_the_text_an_epoch_covers():
    """Rows of 11 and 21 tokens at T = 5: 2 windows each, 20 of the 30 target tokens."""
    ds = Dataset.from_dict({"text": [" ".join(["a"] * 9), " ".join(["b"] * 19)]})
    windows = LMWindows(ds, Vocab.build(ds["text"]), seq_len=5, global_rows=2)
    assert [len(r) for r in windows.rows] == [11, 21] and windows.num_windows == 2
    assert windows.epoch_share == pytest.approx(20 / 30)
    assert windows.describe() == ("2 steps per epoch (67% of the training tokens: the shortest of the 2 rows ends "
                                  "an epoch)")
