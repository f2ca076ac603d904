"""Mixture of attention heads, MoA (Zhang et al. 2022; spec §3.1-3.2), causal, with expert parallelism.

Legend (docs/shapes.md): B sequences, T positions, Tc positions cached for generation, N = B·T query
tokens on this rank, D model width, d head width, E attention experts, L = E / P local experts, P expert-parallel
ranks, Z = P·B sequences of the expert-parallel group, Y query rows a token sends to one rank (min(K, L)),
C (token, expert) pairs, M (token, expert) pairs that arrived here.

    router (softmax top-k, MoA's losses) ─▶ pairs (token, expert, gate)
    K, V = x W_k, x W_v   computed ONCE per sequence, shared by every expert   [B, T, d] each
    K/V all-gathered within the expert-parallel group                          [Z, T, 2d]
    dispatcher: the query token's x row (and its global position) travels to the rank that owns its expert
    expert e:  q = x W_q[e] / √d ;  o = softmax(q Kᵀ + causal) V  (over its own sequence) ;  y = o W_o[e]
    dispatcher: y back to the token's rank, summed with the gates

The expert side runs one batched attention over the group's sequences (see `_experts`).

Why an all-gather of K/V (and not of the queries' results): an expert needs K/V of every sequence whose
tokens chose it, and those can be any sequence of the group. Gathering the shared K/V costs per layer and
rank (P−1)·B·T·2d values in the forward (and the same back in the backward) — with MoA's small d (= D/k)
that is 2/k of the hidden states, against 2·k·N·D for the token all-to-all there and back. The
alternative, sending q back to the token's rank and o forward again, needs two more all-to-alls per layer.
In one process the gather is the identity. The gather is an autograd all-to-all of P copies (gloo has no
reduce-scatter), so every rank gets the K/V gradient its sequences received on any rank.

Attention experts are DeepSpeed expert parameters exactly like the FFN experts of `MoELayer`: both derive from
moe/deepspeed_adapter.py's `ExpertParallelModule` (expert-parallel groups, `allreduce=False` / `group_name`,
one checkpoint file per global expert through the same state-dict hooks).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_autograd
from torch import nn

from moe_scale.distributed.comm import BatchCollectives
from moe_scale.moe.dispatch import AllToAllDispatcher
from moe_scale.moe.experts import grouped_matmul
from moe_scale.moe.kernel_policy import count_per_bin
from moe_scale.moe.deepspeed_adapter import ParallelGroups
from moe_scale.moe.routed_layer import RoutedLayer
from moe_scale.moe.router.softmax_topk import SoftmaxTopKRouter


class AttentionExperts(nn.Module):
    """L local attention experts: w_q [L, D, d] and w_o [L, d, D], Xavier-uniform (MoA's init), each drawn
    from a generator seeded by (seed, global expert id) so an expert starts the same on any rank."""

    def __init__(self, num_local_experts: int, d_model: int, head_dim: int, first_global_expert: int, seed: int):
        super().__init__()
        self.w_q = nn.Parameter(torch.empty(num_local_experts, d_model, head_dim))
        self.w_o = nn.Parameter(torch.empty(num_local_experts, head_dim, d_model))
        bound = math.sqrt(6.0 / (d_model + head_dim))
        with torch.no_grad():
            for local_id in range(num_local_experts):
                generator = torch.Generator().manual_seed(seed * 1_000_003 + 7_919 + first_global_expert + local_id)
                for weight in (self.w_q, self.w_o):
                    weight[local_id].copy_(torch.empty(weight.shape[1:]).uniform_(-bound, bound, generator=generator))


class MoAAttention(RoutedLayer):
    """Causal MoA self-attention; returns (y_BTD, aux_loss). `stats` holds the router's balance numbers."""

    def __init__(self, d_model: int, head_dim: int, num_experts: int, k: int, ep_size: int = 1, ep_rank: int = 0,
                 seed: int = 0, router: nn.Module | None = None, dropout: float = 0.0):
        self.init_routed(num_experts, ep_size, ep_rank,
                         router if router is not None else SoftmaxTopKRouter(d_model, num_experts, k))
        self.k, self.head_dim, self.dropout = k, head_dim, dropout
        self.experts = AttentionExperts(self.num_local_experts, d_model, head_dim,
                                        first_global_expert=ep_rank * self.num_local_experts, seed=seed)
        self.mark_expert_parameters()
        # Shared K and V: one head each, no bias; gain 1/√2 as MoA's code when the q/k/v widths are equal.
        self.k_proj = nn.Linear(d_model, head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, head_dim, bias=False)
        for proj in (self.k_proj, self.v_proj):
            nn.init.xavier_uniform_(proj.weight, gain=1 / math.sqrt(2))
        self.dispatcher = AllToAllDispatcher(num_experts, self.num_local_experts)

    def connect(self, parallel: ParallelGroups) -> None:
        self.router.connect(BatchCollectives(parallel.data_parallel))
        self.dispatcher.connect(parallel.expert_parallel)

    def shared_kv(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """K and V of this rank's sequences, computed once: [B, T, 2d]."""
        return torch.cat([self.k_proj(x_BTD), self.v_proj(x_BTD)], dim=-1)

    def forward(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.require_groups()
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(B * T, D)
        route = self.route(x_ND)
        token_C, expert_C, gate_C = route.pairs()
        kv_ZTd, group_rank = self._gather_over_experts(self.shared_kv(x_BTD))
        # Each query's position in the group's token list travels with its row.
        position_N1 = (group_rank * B * T + torch.arange(B * T, device=x_BTD.device))[:, None]
        # every token has its k rows (a top-k gate): on one rank the dispatch reads no counts
        tokens_MD, state = self.dispatcher.dispatch(x_ND, token_C, expert_C, every_token=True)
        position_M = self.dispatcher.follow(position_N1, state)[:, 0]
        y_MD = self._experts(tokens_MD, position_M, kv_ZTd, T, state.expert_counts())
        return self.dispatcher.combine(y_MD, gate_C, state).to(x_BTD.dtype).view(B, T, D), route.aux_loss

    def decode(self, x_BTD: torch.Tensor, cache: dict) -> torch.Tensor:
        """Generation in one process: the new positions' expert queries attend over the shared K/V of their
        sequence, cached for the earlier positions in cache["kv"] ([B, Tc, 2d], extended here); as forward()."""
        if self.ep_size != 1:
            raise ValueError("MoA decoding runs in one process (build the model with ep_size=1)")
        B, T, D = x_BTD.shape
        d = self.head_dim
        x_ND = x_BTD.reshape(B * T, D)
        route = self.route(x_ND)
        token_C, expert_C, gate_C = route.pairs()
        kv_BTcd = self.shared_kv(x_BTD)
        if "kv" in cache:
            kv_BTcd = torch.cat([cache["kv"], kv_BTcd], dim=1)
        cache["kv"] = kv_BTcd
        Tc = kv_BTcd.shape[1]
        q_C1d = torch.bmm(x_ND[token_C][:, None, :], self.experts.w_q[expert_C].to(x_ND.dtype)) / math.sqrt(d)
        sequence_C, time_C = token_C // T, token_C % T
        visible_CTc = torch.arange(Tc, device=x_BTD.device)[None, :] <= (Tc - T + time_C)[:, None]
        o_C1d = nn.functional.scaled_dot_product_attention(
            q_C1d[:, None], kv_BTcd[sequence_C, None, :, :d], kv_BTcd[sequence_C, None, :, d:],
            attn_mask=visible_CTc[:, None, None, :], scale=1.0)[:, 0]
        y_CD = torch.bmm(o_C1d, self.experts.w_o[expert_C].to(o_C1d.dtype))[:, 0]
        y_ND = x_ND.new_zeros(B * T, D).index_add_(0, token_C, y_CD * gate_C[:, None].to(y_CD.dtype))
        return y_ND.view(B, T, D)

    def _experts(self, tokens_MD, position_M, kv_ZTd, T: int, tokens_per_expert) -> torch.Tensor:
        """Each arrived row's expert query attends over its own sequence's shared K/V (causally).

        The rows are laid out densely as [Z sequences, Y slots, T positions] (Y = min(k, L): a token sends at
        most that many rows to one rank; empty slots hold q = 0 and are never read back), so one batched
        attention over the group's sequences runs with K/V shared by the slots, as in multi-query attention.
        The layout spans all Z = P·B sequences of the group, so its score work is Z·Y·T² against M·T for the
        rows alone (the same in one process, where M = N·k; up to P·Y/k times more with P ranks) — still far
        faster than per-row gathers of K/V on CPU at these sizes."""
        d = self.head_dim
        q_Md = grouped_matmul(tokens_MD, self.experts.w_q.to(tokens_MD.dtype), tokens_per_expert) / math.sqrt(d)
        Z, Y = kv_ZTd.shape[0], min(self.k, self.num_local_experts)
        slot_M = _slot_within_token(position_M, Z * T)
        sequence_M, time_M = position_M // T, position_M % T
        q_ZYTd = q_Md.new_zeros(Z, T, Y, d).index_put((sequence_M, time_M, slot_M), q_Md).transpose(1, 2)
        k_ZYTd = kv_ZTd[:, None, :, :d].expand(Z, Y, T, d)
        v_ZYTd = kv_ZTd[:, None, :, d:].expand(Z, Y, T, d)
        o_ZYTd = nn.functional.scaled_dot_product_attention(
            q_ZYTd, k_ZYTd, v_ZYTd, is_causal=True, scale=1.0, dropout_p=self.dropout if self.training else 0.0)
        o_Md = o_ZYTd.transpose(1, 2)[sequence_M, time_M, slot_M]
        return grouped_matmul(o_Md, self.experts.w_o.to(o_Md.dtype), tokens_per_expert)

    def _gather_over_experts(self, kv_BTd: torch.Tensor) -> tuple[torch.Tensor, int]:
        """([Z, T, 2d] K/V of every sequence of the expert-parallel group in rank order, this rank's index)."""
        group = self.dispatcher.ep_group
        if self.ep_size == 1 or group is None:
            return kv_BTd, 0
        P = self.ep_size
        flat = kv_BTd.reshape(kv_BTd.shape[0], -1)
        out = flat.new_empty(P * flat.shape[0], flat.shape[1])
        gathered = dist_autograd.all_to_all_single(out, flat.repeat(P, 1), group=group)
        return gathered.view(P * kv_BTd.shape[0], *kv_BTd.shape[1:]), dist.get_rank(group)


def _slot_within_token(position_M: torch.Tensor, num_positions: int) -> torch.Tensor:
    """For rows that share a query token (same position), 0, 1, 2, ... in row order."""
    order_M = torch.argsort(position_M, stable=True)
    count_per_position = count_per_bin(position_M, num_positions)
    first_per_position = count_per_position.cumsum(0) - count_per_position
    slot_M = torch.empty_like(position_M)
    slot_M[order_M] = torch.arange(len(position_M), device=position_M.device) - first_per_position[position_M[order_M]]
    return slot_M
