"""Subword tokenizers (data/subwords.py): a byte-level BPE learned from real text, a user's tokenizer.json moved
to moe_scale's ids, the word starts behind per-word perplexity, and the broadcast that gives every rank the
same BPE."""

from __future__ import annotations

import json
import math

import pytest
import torch

from moe_scale.config import DataConfig, RunConfig
from moe_scale.data.eval_windows import EvalWindows
from moe_scale.data.subwords import SubwordTokenizer
from moe_scale.data.vocab import Vocab
from moe_scale.errors import UserError
from moe_scale.models.lstm_lm import LSTMMoELM
from moe_scale.models.softmax import IGNORE
from moe_scale.train.evaluate import evaluate
from tests.wikitext import wikitext_sentences
from tests.multiproc import run_ranks

UNSEEN = ["Zürich 's naïve café — ½ of 🙂 emoji !", "x", "THE   spaced    words", "tab\tseparated words"]


@pytest.fixture(scope="module")
def bpe() -> SubwordTokenizer:
    return SubwordTokenizer.train_bpe(wikitext_sentences("valid")[:3000], vocab_size=600)


def test_bpe_is_deterministic_has_our_specials_and_no_unknown(bpe):
    again = SubwordTokenizer.train_bpe(wikitext_sentences("valid")[:3000], vocab_size=600)
    assert again.to_json() == bpe.to_json() and len(bpe) == 600
    assert [bpe.tokenizer.id_to_token(i) for i in range(3)] == ["<UNK>", "<S>", "</S>"]
    for text in UNSEEN + wikitext_sentences("test")[:200]:
        ids = bpe.encode(text)
        assert ids and min(ids) >= 3                          # never <UNK>, never a special
        assert bpe.decode(ids) == text.strip()                # bytes round-trip exactly
    common = max(range(259, 600), key=lambda i: len(bpe.token_text(i)))
    assert len(bpe.encode(bpe.token_text(common).strip())) == 1   # merges are used


def test_word_starts_count_each_word_once_within_its_pieces(bpe):
    """Reference: a byte-level BPE encodes each whitespace word on its own (with its leading space), so the
    sentence's pieces are the words' pieces in order; each word's pieces carry exactly one start between them
    (on its first piece, or on the piece after a bare leading space)."""
    for text in wikitext_sentences("test")[:300] + UNSEEN[:2]:
        ids, starts = bpe.encode_with_word_starts(text)
        want_ids, first = [], 0
        for word in text.split():
            pieces = bpe.encode(word)
            want_ids += pieces
            assert sum(starts[first:first + len(pieces)]) == 1, (text, word)
            assert starts[first] == 1 or bpe.token_text(ids[first]) == " ", (text, word)
            first += len(pieces)
        assert ids == want_ids, text
    ids, starts = bpe.encode_with_word_starts("THE   spaced \t words")
    assert sum(starts) == 3 and len(ids) == len(starts)
    words_vocab = Vocab.build(["a b c"])
    assert words_vocab.encode_with_word_starts("a zz c") == ([3, 0, 5], [1, 1, 1])


def test_eval_windows_count_words_not_pieces_over_any_number_of_ranks(bpe):
    sentences = wikitext_sentences("test")[:40]
    words = sum(len(s.split()) for s in sentences)
    one = EvalWindows(sentences, bpe, seq_len=16, global_rows=4)
    assert one.counts["words"] == words and one.counts["oov_words"] == 0
    assert one.counts["counted_tokens"] > words + len(sentences)        # pieces outnumber words
    assert sum(one.counted_words(b) for b in range(one.num_batches)) == words + len(sentences)
    for world in (2, 4):
        parts = [EvalWindows(sentences, bpe, 16, 4, rank=r, world_size=world) for r in range(world)]
        assert sum(p.counted_words(b) for p in parts for b in range(p.num_batches)) == words + len(sentences)


def test_per_word_perplexity_by_hand_with_a_bpe(bpe):
    """A model whose softmax ignores its input predicts a fixed p: per-word perplexity = exp(-sum log p over every
    counted piece and </S> / (words + sentences)), per token it would be larger."""
    sentences = wikitext_sentences("test")[:12]
    torch.manual_seed(0)
    model = LSTMMoELM(RunConfig.from_settings(d_model=8, expert_hidden=8, num_experts=4, top_k=2), len(bpe))
    p = torch.rand(len(bpe)) + 0.1
    p = p / p.sum()
    with torch.no_grad():
        model.softmax.proj.weight.zero_()
        model.softmax.proj.bias.copy_(p.log())
    counted = [i for s in sentences for i in bpe.encode(s) + [Vocab.EOS_ID]]
    words = sum(len(s.split()) + 1 for s in sentences)
    nll = -sum(math.log(p[i]) for i in counted)
    for seq_len in (5, 64):
        windows = EvalWindows(sentences, bpe, seq_len, 2)
        targets = torch.cat([t.reshape(-1) for _, t in windows.all_windows()])
        assert targets[targets != IGNORE].tolist() == counted
        result = evaluate(model, windows, describe=True)
        assert result["ppl"] == pytest.approx(math.exp(nll / words), rel=1e-5)
        assert result["nll_per_token"] == pytest.approx(nll / len(counted), rel=1e-5)
        assert result["words_predicted"] == words and result["tokens"] == len(counted)


def _gpt2_style_json(bpe: SubwordTokenizer) -> dict:
    """The same BPE as a tokenizer.json of another library: no <UNK>/<S>/</S>, its own special token at the end,
    a post-processor that names ids."""
    spec = json.loads(bpe.to_json())
    vocab = {t: i - 3 for t, i in spec["model"]["vocab"].items() if i >= 3}
    spec["model"]["vocab"] = {**vocab, "<|endoftext|>": len(vocab)}
    spec["added_tokens"] = [{"id": len(vocab), "content": "<|endoftext|>", "single_word": False, "lstrip": False,
                             "rstrip": False, "normalized": False, "special": True}]
    spec["post_processor"] = {"type": "TemplateProcessing", "single": [{"Sequence": {"id": "A", "type_id": 0}},
                                                                      {"SpecialToken": {"id": "<|endoftext|>",
                                                                                        "type_id": 0}}],
                              "pair": [{"Sequence": {"id": "A", "type_id": 0}}],
                              "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [len(vocab)],
                                                                   "tokens": ["<|endoftext|>"]}}}
    return spec


def test_a_users_tokenizer_json_moves_up_by_three(bpe, tmp_path):
    path = tmp_path / "tokenizer.json"
    spec = _gpt2_style_json(bpe)
    path.write_text(json.dumps(spec))
    from tokenizers import Tokenizer

    theirs = Tokenizer.from_file(str(path))
    ours = SubwordTokenizer.from_user_file(path)
    assert len(ours) == theirs.get_vocab_size() + 3
    for text in UNSEEN + wikitext_sentences("test")[:50]:
        assert ours.encode(text) == [i + 3 for i in theirs.encode(text, add_special_tokens=False).ids]
        assert ours.encode(text) == bpe.encode(text)         # the same merges as the BPE it came from
    assert ours.encode("a <|endoftext|>")[-1] == theirs.token_to_id("<|endoftext|>") + 3
    # one already in moe_scale's ids (a run's own tokenizer.json) is taken as it is
    (tmp_path / "ours.json").write_text(bpe.to_json())
    assert SubwordTokenizer.from_user_file(tmp_path / "ours.json").to_json() == bpe.to_json()


@pytest.mark.parametrize("content, fragment", [
    (None, "no such file"),
    ("{not json", "not a tokenizer.json"),
    ('{"version": "1.0"}', "no 'model' object"),
    ('{"model": {"type": "Nonsense"}}', "cannot load it"),
])
def test_bad_tokenizer_files_are_one_clear_error(tmp_path, content, fragment):
    path = tmp_path / "t.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(UserError, match=fragment):
        SubwordTokenizer.from_user_file(path)
    with pytest.raises(UserError, match="is a directory"):
        SubwordTokenizer.from_user_file(tmp_path)


def test_specials_at_other_ids_are_refused(bpe, tmp_path):
    spec = _gpt2_style_json(bpe)
    spec["model"]["vocab"]["<S>"] = len(spec["model"]["vocab"])
    (tmp_path / "t.json").write_text(json.dumps(spec))
    with pytest.raises(UserError, match="<S> at other ids"):
        SubwordTokenizer.from_user_file(tmp_path / "t.json")


def test_bpe_vocab_size_must_hold_the_bytes():
    with pytest.raises(UserError, match="at least 260"):
        SubwordTokenizer.train_bpe(["a b"], vocab_size=259)


def _bpe_on_rank(rank: int, world_size: int) -> str:
    from moe_scale.train.data_setup import trained_bpe

    # each rank sees different text: only rank 0's may count, the others must receive it
    sentences = wikitext_sentences("valid")[:800] if rank == 0 else ["other text entirely"] * 10
    return trained_bpe(lambda: sentences, DataConfig(tokenizer="bpe", vocab_size=400)).to_json()


@pytest.mark.multiprocess
def test_every_rank_gets_rank_zeros_bpe():
    texts = run_ranks(_bpe_on_rank, world_size=2)
    assert texts[0] == texts[1]
    assert texts[0] == SubwordTokenizer.train_bpe(wikitext_sentences("valid")[:800], 400).to_json()


@pytest.mark.parametrize("stream", [False, True], ids=["in-memory", "streamed"])
def test_training_data_with_a_bpe_counts_tokens_per_word(tmp_path, stream):
    """build_lm_data learns the BPE from the training split (in memory, or in one pass over the shards) and the
    batches know the text's tokens per word, which turns the training loss into a per-word perplexity."""
    from moe_scale.distributed.launch import DistEnv
    from moe_scale.train.data_setup import build_lm_data

    train, valid = wikitext_sentences("valid")[:600], wikitext_sentences("test")[:100]
    (tmp_path / "train.txt").write_text("\n".join(train) + "\n")
    (tmp_path / "valid.txt").write_text("\n".join(valid) + "\n")
    (tmp_path / "test.txt").write_text("\n".join(valid) + "\n")
    config = DataConfig(data=str(tmp_path), tokenizer="bpe", vocab_size=400, seq_len=8, stream=stream,
                        shuffle_buffer=1)
    data = build_lm_data(config, DistEnv(0, 1, 0, torch.device("cpu"), "gloo"), global_rows=2, saved_run=None)
    assert data.vocab.to_json() == SubwordTokenizer.train_bpe(train, 400).to_json()
    if stream:
        for step in range(40):
            data.train.batch(step)
        words, m = 0, 0   # no shuffling: the reader has encoded the first m sentences
        while words < data.train.readers[0].words_read:
            words, m = words + len(train[m].split()) + 1, m + 1
        train = train[:m]
    ratio = sum(len(data.vocab.encode(s)) + 1 for s in train) / sum(len(s.split()) + 1 for s in train)
    assert data.train.tokens_per_word == pytest.approx(ratio, rel=1e-12)
    assert data.train.tokens_per_word > 1.2
