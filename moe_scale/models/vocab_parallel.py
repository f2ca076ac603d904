"""The embedding and output tables split by rows over the processes of a run (`--vocab-exchange rows`).

Legend (docs/shapes.md): N tokens, D model width, V vocabulary, P ranks (every process of the run), R table rows
this rank holds, U distinct ids this rank's batch needs, S classes drawn per batch, K ids asked for (N, or N + S),
M tokens of all P ranks (Σ N).

With P > 1 each rank holds rows [first, first + R) of every vocabulary table (`VocabRows`) and the rows' optimizer
state, so the tables' memory falls with P, whatever --ep-size; no gradient of theirs is reduced: each row lives on
one rank, which receives every rank's contribution to it. What moves instead of the 2·V·D gradient all-reduce:

    embedding         the U distinct ids of this rank's batch go to their owners and U rows come back (one
                      all-to-all each way, and the reverse for the rows' gradients);
    sampled softmax   the same for the distinct classes of this rank's batch (its targets and the S samples);
    full softmax      this rank's hidden states go to every rank of the group (M rows); each rank computes the
                      logits of its R classes for all M tokens, and the log-partition is summed over the ranks
                      (Megatron's vocabulary-parallel cross-entropy, with each rank's own tokens);
    adaptive softmax  the same per tail cluster, for the tokens whose targets lie in it (each cluster's table split
                      by its own rows; the head and the tails' down-projections stay whole).

The tables' parameters are flagged as DeepSpeed expert parameters of the group `ep_size_P` over all P ranks
(`allreduce=False`, `group_name`): DeepSpeed reduces them over that group's expert-data-parallel group (one rank:
nothing), ZeRO leaves each rank its rows and their Adam state, and the expert-aware clipping counts each row once.
They are flagged `ROW_SPLIT_TABLE` too: no expert matrix, so --optimizer factored gives them AdamW, as one process
gives the whole tables.
Built from the model's dense modules (`shard_vocabulary`), so a seed gives the rows it gives one process; one
process never uses this file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe_scale.distributed.comm import BatchCollectives
from moe_scale.moe.dispatch.exchange import CommTimer, all_to_all_plain
from moe_scale.models.softmax import IGNORE, AdaptiveSoftmax, FullSoftmax, SampledSoftmax


@dataclass(frozen=True)
class VocabRows:
    """Rows [first, first + count) of a table of `total` rows, split in `parts` ranks of ceil(total / parts)."""

    total: int
    parts: int
    rank: int

    @property
    def per_part(self) -> int:
        return -(-self.total // self.parts)

    @property
    def first(self) -> int:
        return min(self.rank * self.per_part, self.total)

    @property
    def count(self) -> int:
        return min(self.first + self.per_part, self.total) - self.first

    def __post_init__(self):
        if (self.parts - 1) * self.per_part >= self.total:
            raise ValueError(f"a vocabulary of {self.total} cannot be split over {self.parts} ranks with rows on each")

    def owner(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.div(ids, self.per_part, rounding_mode="floor")


class VocabGroup:
    """The ranks the tables are split over (DeepSpeed's expert-parallel group of all P processes, as it built it);
    and the exchanges' time."""

    def __init__(self, rows: VocabRows):
        self.rows = rows
        self.expert_group_name = f"ep_size_{rows.parts}"
        self.group = None
        self.expert_data_parallel = None
        self.timer = CommTimer()

    def connect(self, expert_parallel, expert_data_parallel) -> None:
        if dist.get_world_size(expert_parallel) != self.rows.parts or \
                dist.get_rank(expert_parallel) != self.rows.rank:
            raise RuntimeError(f"vocabulary rows built for rank {self.rows.rank} of {self.rows.parts}, but this "
                               f"process is rank {dist.get_rank(expert_parallel)} of "
                               f"{dist.get_world_size(expert_parallel)} of the group it was given")
        self.group, self.expert_data_parallel = expert_parallel, expert_data_parallel

    def require(self):
        if self.group is None:
            raise RuntimeError("vocabulary rows split over ranks need connect_vocabulary() (TrainingEngine calls it)")
        return self.group


def _read_counts(counts: torch.Tensor) -> list:
    """The one read to the host an exchange of rows needs: its split sizes (all_to_all_single and all_gather take
    them as Python ints). tools/step_syncs.py counts reads made here as such."""
    return counts.tolist()


def _distinct(ids_K: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the distinct ids, sorted, in the first slots of [K] (the rest 0), a mask of those slots, each id's slot [K]):
    torch.unique without its read of the output size to the host."""
    sorted_K, order_K = torch.sort(ids_K)
    first_K = torch.ones_like(sorted_K, dtype=torch.bool)
    first_K[1:] = sorted_K[1:] != sorted_K[:-1]
    slot_sorted_K = torch.cumsum(first_K, 0) - 1
    where_K = torch.empty_like(slot_sorted_K).scatter_(0, order_K, slot_sorted_K)
    distinct_K = torch.zeros_like(ids_K).scatter_(0, slot_sorted_K, sorted_K)
    filled_K = torch.arange(ids_K.shape[0], device=ids_K.device) <= slot_sorted_K[-1]
    return distinct_K, filled_K, where_K


class _FetchRows(torch.autograd.Function):
    """Rows of tables split by rows, for the distinct ids in the first slots of `distinct_K` (sorted; `filled_K`
    marks them): [U, ...] for each shard [R, ...]. The ids go to their owners and the rows come back; in the
    backward the rows' gradients go to the owners and are summed into the shards' gradients."""

    @staticmethod
    def forward(ctx, distinct_K, filled_K, vocab: VocabGroup, *shards):
        group, rows = vocab.require(), vocab.rows
        owner_K = rows.owner(distinct_K)
        send_P = torch.zeros(rows.parts, dtype=torch.int64, device=distinct_K.device).index_add_(
            0, owner_K, filled_K.long())   # (bincount would read the largest id to the host)
        recv_P = torch.empty_like(send_P)
        vocab.timer.run(lambda: dist.all_to_all_single(recv_P, send_P, group=group), send_P.device)
        send, recv = _read_counts(torch.stack([send_P, recv_P]))
        ids_U = distinct_K[:sum(send)]
        asked = vocab.timer.run(lambda: all_to_all_plain(ids_U, recv, send, group), ids_U.device) - rows.first
        widths = [s[0].numel() for s in shards]
        flat = torch.cat([s.reshape(s.shape[0], -1)[asked] for s in shards], dim=1)
        back = vocab.timer.run(lambda: all_to_all_plain(flat, send, recv, group), flat.device)
        ctx.vocab, ctx.splits, ctx.widths = vocab, (send, recv), widths
        ctx.shapes = [s.shape for s in shards]
        ctx.save_for_backward(asked)
        return tuple(part.reshape(-1, *shape[1:]) for part, shape in zip(back.split(widths, dim=1), ctx.shapes))

    @staticmethod
    def backward(ctx, *grads_U):
        (asked,) = ctx.saved_tensors
        send, recv = ctx.splits
        flat = torch.cat([g.reshape(g.shape[0], -1) for g in grads_U], dim=1)
        arrived = ctx.vocab.timer.run(lambda: all_to_all_plain(flat, recv, send, ctx.vocab.group), flat.device)
        out = []
        for part, shape in zip(arrived.split(ctx.widths, dim=1), ctx.shapes):
            grad = part.new_zeros((shape[0], part.shape[1])).index_add_(0, asked, part)
            out.append(grad.view(shape))
        return (None, None, None, *out)


def fetch_rows(vocab: VocabGroup, ids_K: torch.Tensor, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(the rows of each shard's table for the distinct ids among `ids_K` [U, ...] each, then each id's row among
    them [K])."""
    distinct_K, filled_K, where_K = _distinct(ids_K)
    return (*_FetchRows.apply(distinct_K, filled_K, vocab, *shards), where_K)


def _row_counts(vocab: VocabGroup, num_rows: int, device) -> list[int]:
    """How many rows each rank of the group holds (one small all-reduce and its read)."""
    sizes_P = torch.zeros(vocab.rows.parts, dtype=torch.int64, device=device)
    sizes_P[vocab.rows.rank] = num_rows
    dist.all_reduce(sizes_P, group=vocab.require())
    return _read_counts(sizes_P)


class _GatherRows(torch.autograd.Function):
    """Every rank's rows in rank order [M, ...] (`sizes`: each rank's count); the backward sums the gradient of
    this rank's rows over the ranks (each rank's loss used every rank's rows)."""

    @staticmethod
    def forward(ctx, x, vocab: VocabGroup, sizes: list[int]):
        padded = x.new_zeros((max(sizes), *x.shape[1:]))
        padded[: x.shape[0]] = x
        pieces = [torch.empty_like(padded) for _ in sizes]
        vocab.timer.run(lambda: dist.all_gather(pieces, padded, group=vocab.group), x.device)
        ctx.vocab, ctx.sizes = vocab, sizes
        return torch.cat([piece[:size] for piece, size in zip(pieces, sizes)])

    @staticmethod
    def backward(ctx, grad_M):
        sizes, rank = ctx.sizes, ctx.vocab.rows.rank
        grad_M = grad_M.contiguous()
        ctx.vocab.timer.run(lambda: dist.all_reduce(grad_M, group=ctx.vocab.group), grad_M.device)
        start = sum(sizes[:rank])
        return grad_M[start:start + sizes[rank]], None, None


def _keep_rows_out_of_state_dicts(module: nn.Module) -> None:
    """A row-split module's state dict leaves its rows out: checkpoints keep them per rank (train/reshard.py's
    portable files), since DeepSpeed writes one rank's module state. Loading a whole table (from one process or
    --vocab-exchange dense) takes this rank's rows of it."""
    module._register_state_dict_hook(_drop_rows)
    module._register_load_state_dict_pre_hook(_rows_of_whole_table, with_module=True)


def _drop_rows(module, state_dict, prefix, local_metadata):
    for name, _ in module.named_parameters(recurse=False):
        state_dict.pop(prefix + name, None)
    return state_dict


def _rows_of_whole_table(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                         error_msgs):
    rows = module.vocab.rows
    for name, _ in module.named_parameters(recurse=False):
        whole = state_dict.get(prefix + name)
        if whole is not None and whole.shape[0] == rows.total:
            state_dict[prefix + name] = whole[rows.first:rows.first + rows.count]


ROW_SPLIT_TABLE = "row_split_table"   # a parameter's attribute: a vocabulary table's rows, not an expert's weights


def _mark(param: nn.Parameter, vocab: VocabGroup) -> nn.Parameter:
    param.allreduce = False
    param.group_name = vocab.expert_group_name
    setattr(param, ROW_SPLIT_TABLE, True)
    return param


def _rows_of(tensor: torch.Tensor, rows: VocabRows) -> nn.Parameter:
    return nn.Parameter(tensor.detach()[rows.first:rows.first + rows.count].clone())


class ShardedEmbedding(nn.Module):
    """nn.Embedding whose rows are split over the ranks: `weight` [R, D]."""

    def __init__(self, dense: nn.Embedding, vocab: VocabGroup, weight: nn.Parameter | None = None):
        super().__init__()
        self.vocab = vocab
        self.weight = weight if weight is not None else _mark(_rows_of(dense.weight, vocab.rows), vocab)
        _keep_rows_out_of_state_dicts(self)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows_UD, where = fetch_rows(self.vocab, ids.reshape(-1), self.weight)
        return rows_UD[where].view(*ids.shape, -1)


class ShardedOutput(nn.Module):
    """A linear output layer (weight [V, D], bias [V] or none) split by rows: `weight` [R, D], `bias` [R]."""

    def __init__(self, dense: nn.Linear, vocab: VocabGroup, weight: nn.Parameter | None = None):
        super().__init__()
        self.vocab = vocab
        self.weight = weight if weight is not None else _mark(_rows_of(dense.weight, vocab.rows), vocab)
        self.bias = None if dense.bias is None else _mark(_rows_of(dense.bias, vocab.rows), vocab)
        self.in_features, self.out_features = dense.in_features, dense.out_features
        _keep_rows_out_of_state_dicts(self)

    def local_logits(self, h_MD: torch.Tensor) -> torch.Tensor:
        """[M, R] float32: the logits of this rank's classes."""
        return F.linear(h_MD, self.weight, self.bias).float()

    def nll(self, h_ND: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
        """Per-token NLL [N] float32 of the exact softmax over all V classes, for this rank's tokens."""
        vocab, rows = self.vocab, self.vocab.rows
        sizes = _row_counts(vocab, h_ND.shape[0], h_ND.device)
        if not any(sizes):   # an adaptive-softmax cluster no rank's batch reached
            return h_ND.new_zeros(0, dtype=torch.float32)
        start = sum(sizes[:rows.rank])
        h_MD = _GatherRows.apply(h_ND, vocab, sizes)
        targets_M = _GatherRows.apply(targets_N, vocab, sizes)
        logits_MR = self.local_logits(h_MD)
        group = vocab.group
        max_M = logits_MR.detach().max(dim=1).values
        dist.all_reduce(max_M, op=dist.ReduceOp.MAX, group=group)
        summed = BatchCollectives(group)   # sums whose backward sums the gradients over the ranks too
        sum_exp_M = summed.sum((logits_MR - max_M[:, None]).exp().sum(dim=1))
        local_M = targets_M - rows.first
        mine_M = (local_M >= 0) & (local_M < rows.count)
        picked_M = logits_MR.gather(1, torch.where(mine_M, local_M, 0)[:, None])
        target_M = summed.sum(torch.where(mine_M, picked_M[:, 0], 0.0))
        nll_M = sum_exp_M.log() + max_M - target_M
        nll_N = nll_M[start:start + h_ND.shape[0]]
        counted_N = targets_N != IGNORE
        return torch.where(counted_N, nll_N, torch.zeros_like(nll_N))

    def log_probs(self, h_ND: torch.Tensor) -> torch.Tensor:
        """[N, V] float32 (generation): every rank's logits of this rank's tokens, joined, then log-softmax."""
        vocab = self.vocab
        sizes = _row_counts(vocab, h_ND.shape[0], h_ND.device)
        start = sum(sizes[:vocab.rows.rank])
        h_MD = _GatherRows.apply(h_ND, vocab, sizes)
        logits_MR = self.local_logits(h_MD)
        per_part = vocab.rows.per_part
        padded = logits_MR.new_full((h_MD.shape[0], per_part), -math.inf)
        padded[:, :logits_MR.shape[1]] = logits_MR
        pieces = [torch.empty_like(padded) for _ in range(vocab.rows.parts)]
        dist.all_gather(pieces, padded.contiguous(), group=vocab.group)
        logits_MV = torch.cat(pieces, dim=1)[:, :vocab.rows.total]
        return torch.log_softmax(logits_MV[start:start + h_ND.shape[0]], dim=-1)


class ShardedFullSoftmax(FullSoftmax):
    """FullSoftmax with its rows split over the ranks."""

    def __init__(self, dense: FullSoftmax, vocab: VocabGroup, weight: nn.Parameter | None = None):
        nn.Module.__init__(self)
        self.proj = ShardedOutput(dense.proj, vocab, weight)

    def forward(self, h_ND: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
        return self.proj.nll(h_ND, targets_N)

    def log_probs(self, h_ND: torch.Tensor) -> torch.Tensor:
        return self.proj.log_probs(h_ND)


class ShardedAdaptiveSoftmax(AdaptiveSoftmax):
    """AdaptiveSoftmax with each tail cluster's output table split by rows over the ranks (one VocabRows per
    cluster); the head, which every token needs, and the tails' down-projections stay whole. A cluster's log-softmax
    is ShardedOutput's over the tokens of all ranks whose targets lie in it; the head's as the dense layer's."""

    def __init__(self, dense: AdaptiveSoftmax, rank: int, parts: int):
        nn.Module.__init__(self)
        self.inner, self.cluster_shares = dense.inner, dense.cluster_shares
        for tail in self.inner.tail:
            up = tail[1]
            try:
                rows = VocabRows(up.out_features, parts, rank)
            except ValueError:
                raise ValueError(f"an adaptive-softmax cluster of {up.out_features} words cannot be split over "
                                 f"{parts} ranks with rows on each (--adaptive-cutoffs)") from None
            tail[1] = ShardedOutput(up, VocabGroup(rows))

    def forward(self, h_ND: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
        inner, h_ND = self.inner, h_ND.float()
        counted_N = targets_N != IGNORE
        safe_N = torch.where(counted_N, targets_N, torch.zeros_like(targets_N))
        head_N = safe_N   # the head's entry of each token: its word, or its cluster's
        tails_N = h_ND.new_zeros(h_ND.shape[0])
        for i, tail in enumerate(inner.tail):
            low, high = inner.cutoffs[i], inner.cutoffs[i + 1]
            in_N = (safe_N >= low) & (safe_N < high)
            head_N = torch.where(in_N, inner.shortlist_size + i, head_N)
            picked = in_N.nonzero().squeeze(1)   # every rank takes part, with or without tokens of the cluster
            tails_N = tails_N.index_add(0, picked, tail[1].nll(tail[0](h_ND[picked]), safe_N[picked] - low))
        head_log_probs = torch.log_softmax(inner.head(h_ND), dim=1)
        nll_N = tails_N - head_log_probs.gather(1, head_N[:, None])[:, 0]
        return torch.where(counted_N, nll_N, torch.zeros_like(nll_N))

    def log_probs(self, h_ND: torch.Tensor) -> torch.Tensor:
        inner, h_ND = self.inner, h_ND.float()
        head_log_probs = torch.log_softmax(inner.head(h_ND), dim=1)
        pieces = [head_log_probs[:, :inner.shortlist_size]]
        for i, tail in enumerate(inner.tail):
            pieces.append(tail[1].log_probs(tail[0](h_ND)) + head_log_probs[:, inner.shortlist_size + i, None])
        return torch.cat(pieces, dim=1)


class ShardedSampledSoftmax(SampledSoftmax):
    """SampledSoftmax with its rows split over the ranks: the rows of the batch's distinct classes (its targets and
    the samples) are fetched from their owners, and the loss is SampledSoftmax's term for term; exact at eval."""

    def __init__(self, dense: SampledSoftmax, vocab: VocabGroup, weight: nn.Parameter | None = None):
        nn.Module.__init__(self)
        self.proj = ShardedOutput(dense.proj, vocab, weight)
        self.num_sampled, self.sampler, self.generator = dense.num_sampled, dense.sampler, dense.generator
        self._log_q_on: dict[torch.device, torch.Tensor] = {}

    def class_rows(self, targets_N: torch.Tensor, sampled_S: torch.Tensor):
        N, proj, ids = targets_N.shape[0], self.proj, torch.cat([targets_N, sampled_S])
        if proj.bias is None:
            w_UD, where = fetch_rows(proj.vocab, ids, proj.weight)
            return w_UD[where[:N]], w_UD[where[N:]], None, None
        w_UD, b_U, where = fetch_rows(proj.vocab, ids, proj.weight, proj.bias)
        return w_UD[where[:N]], w_UD[where[N:]], b_U[where[:N]], b_U[where[N:]]

    def exact_nll(self, h_ND: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
        return self.proj.nll(h_ND, targets_N)

    def log_probs(self, h_ND: torch.Tensor) -> torch.Tensor:
        return self.proj.log_probs(h_ND)


def row_split_tables(model: nn.Module) -> list[nn.Parameter]:
    """The parameters `shard_vocabulary` splits: the embedding's, the full or sampled softmax's (once if tied), the
    adaptive softmax's tail output tables."""
    params = [model.embedding.weight]
    if isinstance(model.softmax, (SampledSoftmax, FullSoftmax)):
        params += list(model.softmax.proj.parameters())
    elif isinstance(model.softmax, AdaptiveSoftmax):
        params += [tail[1].weight for tail in model.softmax.inner.tail]
    return list({id(p): p for p in params}.values())


def shard_vocabulary(model: nn.Module, rows: VocabRows) -> VocabGroup:
    """Replaces `model.embedding` and `model.softmax` (full, sampled or adaptive) by their row-split counterparts
    holding `rows` (the adaptive softmax's tails: their own rows of each cluster), with the values the dense
    modules were initialised with; a tied output layer keeps sharing the embedding's rows. Returns the group to
    connect."""
    vocab = VocabGroup(rows)
    dense_embedding, softmax = model.embedding, model.softmax
    model.embedding = ShardedEmbedding(dense_embedding, vocab)
    tied = getattr(getattr(softmax, "proj", None), "weight", None) is dense_embedding.weight
    weight = model.embedding.weight if tied else None
    if isinstance(softmax, SampledSoftmax):
        model.softmax = ShardedSampledSoftmax(softmax, vocab, weight)
    elif isinstance(softmax, FullSoftmax):
        model.softmax = ShardedFullSoftmax(softmax, vocab, weight)
    elif isinstance(softmax, AdaptiveSoftmax):
        model.softmax = ShardedAdaptiveSoftmax(softmax, rows.rank, rows.parts)
    else:
        raise TypeError(f"no row-split form of {type(softmax).__name__}")
    return vocab


def vocabulary_groups(model: nn.Module) -> list[VocabGroup]:
    found = {id(m.vocab): m.vocab for m in model.modules() if isinstance(m, (ShardedEmbedding, ShardedOutput))}
    return list(found.values())


@dataclass(frozen=True)
class RowShard:
    """A parameter holding rows [first, first + its rows) of a table of `total` rows, on `rank`."""

    param: nn.Parameter
    first: int
    total: int
    rank: int


def vocabulary_shards(model: nn.Module) -> dict[str, RowShard]:
    """Every row-split parameter by its name in `model` (a tied table once, by its first name)."""
    found, seen = {}, set()
    for prefix, module in model.named_modules():
        if isinstance(module, (ShardedEmbedding, ShardedOutput)):
            rows = module.vocab.rows
            for name, param in module.named_parameters(recurse=False):
                if id(param) not in seen:
                    seen.add(id(param))
                    found[f"{prefix}.{name}" if prefix else name] = RowShard(param, rows.first, rows.total, rows.rank)
    return found


def row_split_keys(model: nn.Module) -> set[str]:
    """The state-dict keys the row-split modules leave out of `model.state_dict()` (a tied table's under each name)."""
    return {f"{prefix}.{name}" if prefix else name for prefix, module in model.named_modules()
            if isinstance(module, (ShardedEmbedding, ShardedOutput))
            for name, _ in module.named_parameters(recurse=False)}


def names_of(model: nn.Module, names: set[str]) -> set[str]:
    """Every name of the parameters `names` in `model`: theirs and their aliases (a tied output layer's)."""
    by_name = dict(model.named_parameters())
    wanted = {id(by_name[name]) for name in names if name in by_name}
    return {name for name, p in model.named_parameters(remove_duplicate=False) if id(p) in wanted}


def connect_vocabulary(model: nn.Module, use_data_before_expert_parallel: bool = False) -> None:
    """Joins each row-split table to DeepSpeed's expert-parallel group of its size (created here when no expert
    layer has created it yet: collective, every rank calls it), before deepspeed.initialize, whose ZeRO looks the
    tables' group up by name."""
    from moe_scale.deepspeed_internals import expert_parallel_groups

    for vocab in vocabulary_groups(model):
        expert_parallel, _, expert_data_parallel, _ = expert_parallel_groups(
            vocab.expert_group_name, vocab.rows.parts, use_data_before_expert_parallel)
        vocab.connect(expert_parallel, expert_data_parallel)


def split_parameter_groups(model: nn.Module) -> dict[str, object]:
    """{group name: expert-data-parallel group} of every parameter DeepSpeed treats as an expert parameter: the
    expert layers' and the row-split tables' (the ranks whose copies of those parameters are summed)."""
    from moe_scale.moe.deepspeed_adapter import expert_data_parallel_groups

    groups = expert_data_parallel_groups(model)
    for vocab in vocabulary_groups(model):
        vocab.require()
        groups.setdefault(vocab.expert_group_name, vocab.expert_data_parallel)
    return groups
