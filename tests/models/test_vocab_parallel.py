"""Vocabulary tables split by rows (models/vocab_parallel.py) against the dense modules they were made from.

Each rank holds a share of the rows and a share of the tokens; the losses, log-probabilities and the tables'
gradients (each row on its owner, summed over every rank's tokens) must equal one process's on all the tokens.
"""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest
import torch
from torch import nn

from moe_scale.models.softmax import IGNORE, AdaptiveSoftmax, FullSoftmax, LogUniformSampler, SampledSoftmax
from moe_scale.models.vocab_parallel import VocabRows
from tests.multiproc import run_ranks

V, D, N = 37, 6, 10
CUTOFFS = [8, 20]   # the adaptive softmax: a head of 8 words, tails of 12 and 17


class _Holder(nn.Module):
    def __init__(self, kind: str, tied: bool, bias: bool):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(V, D)
        full = FullSoftmax(D, V, bias=bias)
        if tied:
            full.proj.weight = self.embedding.weight
        if kind == "full":
            self.softmax = full
        elif kind == "adaptive":
            self.softmax = AdaptiveSoftmax(D, V, CUTOFFS, div_value=2.0)
        else:
            self.softmax = SampledSoftmax(D, V, 8, LogUniformSampler(V), proj=full.proj)

    def forward(self, ids_N, targets_N, sample_seed: int):
        torch.manual_seed(sample_seed)   # the samples: the same on every rank, as the trainer seeds each step
        h_ND = torch.tanh(self.embedding(ids_N) * 1.5)
        return self.softmax(h_ND, targets_N)


def _batch():
    """Rank 1's targets all lie in the adaptive softmax's head: it takes part in the tails' exchanges without tokens."""
    g = torch.Generator().manual_seed(1)
    ids, targets = torch.randint(0, V, (2 * N,), generator=g), torch.randint(0, V, (2 * N,), generator=g)
    targets[N:] = torch.randint(0, CUTOFFS[0], (N,), generator=g)
    targets[3] = IGNORE
    return ids, targets


def _dense(kind, tied, bias):
    model = _Holder(kind, tied, bias)
    ids, targets = _batch()
    nll = model(ids, targets, sample_seed=5)
    nll.sum().backward()
    model.eval()
    with torch.no_grad():
        exact = model(ids, targets, sample_seed=5)
        log_probs = model.softmax.log_probs(torch.tanh(model.embedding(ids) * 1.5))
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return nll.detach(), exact, log_probs, grads


def _worker(rank, world, kind, tied, bias):
    import torch.distributed as dist
    from moe_scale.models.vocab_parallel import ShardedEmbedding, shard_vocabulary, vocabulary_groups, \
        vocabulary_shards

    model = _Holder(kind, tied, bias)
    rows = VocabRows(V, world, rank)
    vocab = shard_vocabulary(model, rows)
    groups = vocabulary_groups(model)
    assert groups[0] is vocab and len(groups) == (1 + len(CUTOFFS) if kind == "adaptive" else 1)
    for group in groups:
        group.connect(dist.group.WORLD, None)
    assert isinstance(model.embedding, ShardedEmbedding)
    if kind != "adaptive":
        assert (model.softmax.proj.weight is model.embedding.weight) == tied
    ids, targets = _batch()
    mine = slice(rank * N, (rank + 1) * N)
    nll = model(ids[mine], targets[mine], sample_seed=5)
    nll.sum().backward()
    model.eval()
    with torch.no_grad():
        exact = model(ids[mine], targets[mine], sample_seed=5)
        log_probs = model.softmax.log_probs(torch.tanh(model.embedding(ids[mine]) * 1.5))
        # a batch no rank of which reaches a tail: the tails' exchanges are skipped alike on every rank
        head_only = torch.arange(N) % CUTOFFS[0]
        dense = _Holder(kind, tied, bias).eval()
        torch.testing.assert_close(model(ids[mine], head_only, 5), dense(ids[mine], head_only, 5))
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    split = {name: (shard.first, shard.param.shape[0]) for name, shard in vocabulary_shards(model).items()}
    flags = {name: (p.allreduce, p.group_name) for name, p in model.named_parameters() if name in split}
    return nll.detach(), exact, log_probs, grads, split, flags


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind,tied,bias", [("full", False, True), ("sampled", False, True),
                                            ("sampled", True, False), ("full", True, False),
                                            ("adaptive", False, True)])
def test_row_split_tables_equal_the_dense_ones(kind, tied, bias):
    nll, exact, log_probs, grads = _dense(kind, tied, bias)
    results = run_ranks(_worker, world_size=2, args=(kind, tied, bias), timeout=60)
    got_nll = torch.cat([r[0] for r in results])
    torch.testing.assert_close(got_nll, nll, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.cat([r[1] for r in results]), exact, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.cat([r[2] for r in results]), log_probs, rtol=1e-5, atol=1e-6)
    assert got_nll[3] == 0   # an ignored target counts nothing
    split = results[0][4]
    for name, grad in grads.items():
        if name in split:   # each rank holds its rows' gradient, summed over every rank's tokens
            pieces = [r[3][name] for r in results]
            assert [r[4][name][0] for r in results] == [0, pieces[0].shape[0]]
            torch.testing.assert_close(torch.cat(pieces), grad, rtol=1e-5, atol=1e-6)
            assert all(r[5][name] == (False, "ep_size_2") for r in results)
        else:   # a whole parameter (the adaptive head and down-projections): its own tokens' share on each rank
            torch.testing.assert_close(sum(r[3][name] for r in results), grad, rtol=1e-5, atol=1e-6)
    assert sum(shard[1] for shard in split.values()) < sum(grads[name].shape[0] for name in split)


def test_rows_split_evenly_and_refuse_an_empty_rank():
    assert [(VocabRows(10, 4, r).first, VocabRows(10, 4, r).count) for r in range(4)] == \
        [(0, 3), (3, 3), (6, 3), (9, 1)]
    assert VocabRows(10, 4, 0).owner(torch.tensor([0, 2, 3, 9])).tolist() == [0, 0, 1, 3]
    with pytest.raises(ValueError, match="cannot be split over 4 ranks"):
        VocabRows(9, 4, 0)


def test_distinct_ids_equal_torch_unique_without_reading_a_size():
    from op_count import OpCounter
    from moe_scale.models.vocab_parallel import _distinct

    for ids in (torch.tensor([5, 3, 5, 0, 3, 9]), torch.tensor([4]), torch.randint(0, 50, (300,))):
        with OpCounter() as counter:
            distinct, filled, where = _distinct(ids)
        assert counter.host_syncs == 0
        unique, inverse = torch.unique(ids, sorted=True, return_inverse=True)
        assert int(filled.sum()) == unique.numel() and bool(filled[:unique.numel()].all())
        assert torch.equal(distinct[:unique.numel()], unique) and torch.equal(where, inverse)


def test_a_vocabulary_too_small_to_split_is_one_line_naming_the_flag():
    from moe_scale.config import RunConfig
    from moe_scale.errors import UserError
    from moe_scale.models.build import build_model

    config = RunConfig.from_settings(d_model=8, expert_hidden=8, num_experts=4, top_k=1, vocab_size=5)
    with pytest.raises(UserError, match="a vocabulary of 5 cannot be split over 4 ranks.*use --vocab-exchange dense"):
        build_model(config, 5, ep_size=4, ep_rank=1, world=4, rank=1)
    config.parallel.vocab_exchange = "dense"
    whole = build_model(config, 5, ep_size=4, ep_rank=1, world=4, rank=1)
    assert whole.embedding.weight.shape == (5, 8)
