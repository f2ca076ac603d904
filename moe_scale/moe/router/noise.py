"""Where a gate's noise comes from: the global RNG by default, or the global token index (`GlobalTokenNoise`)."""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from moe_scale.moe.cpu_backend import kernels as cpu_kernels

NoiseSampler = Callable[[int, int, torch.device], Tensor]


def sample_noise(sampler: Optional[NoiseSampler], n: int, e: int, device: torch.device) -> Tensor:
    """Standard normal noise [n, e]: from the installed sampler (e.g. GlobalTokenNoise), else seeded by the
    global RNG: on CPU from the native counter-based generator (torch.randn's Mersenne Twister is serial),
    elsewhere or without the kernels from torch.randn."""
    if sampler is not None:
        return sampler(n, e, device)
    if torch.device(device).type == "cpu" and cpu_kernels.available(torch.empty(0)):
        return cpu_kernels.standard_normal(n, e)
    return torch.randn(n, e, device=device)


def _mix_seed(*values: int) -> int:
    """Deterministic 63-bit seed from a tuple of ints (splitmix64 steps), identical on every rank and run."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & 0xFFFFFFFFFFFFFFFF)) & 0xFFFFFFFFFFFFFFFF
        h = (h + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h >> 1


class GlobalTokenNoise:
    """Noise that depends on the global token index, so a 1-process run and an N-process run with the same
    global batch draw identical noise (used by the multi-process equivalence tests and ``--noise-rng global``).

    Every rank generates the noise of the whole global batch ``[N_local * world_size, E]`` from a CPU generator
    seeded with (seed, layer_index, step, micro_step) and keeps its own rows ``[rank*N_local, (rank+1)*N_local)``.
    A CPU generator makes the noise independent of the device type. Assumes every rank has the same N_local (the
    global batch is split evenly). Costs global tokens x experts memory and time: a test/debug option, not the default.

    Call ``set_step(step)`` once per optimizer step; each call within the step (gradient-accumulation micro-steps)
    advances a micro-step counter, so micro-batches draw different noise. A forward that is recomputed (activation
    checkpointing) would advance the counter too: don't combine the two.
    """

    def __init__(self, seed: int, layer_index: int, rank: int, world_size: int):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.seed, self.layer_index, self.rank, self.world_size = seed, layer_index, rank, world_size
        self.step, self.micro_step = 0, 0

    def set_step(self, step: int) -> None:
        self.step, self.micro_step = step, 0

    def _global(self, n_rows_local: int, width: int) -> Tensor:
        gen = torch.Generator(device="cpu")
        gen.manual_seed(_mix_seed(self.seed, self.layer_index, self.step, self.micro_step))
        self.micro_step += 1
        return torch.randn(n_rows_local * self.world_size, width, generator=gen)

    def __call__(self, n_tokens_local: int, n_experts: int, device) -> Tensor:
        start = self.rank * n_tokens_local
        return self._global(n_tokens_local, n_experts)[start : start + n_tokens_local].to(device)

    def first_row(self, n_rows_local: int) -> int:
        """The global index of this rank's first row when every rank has `n_rows_local` rows."""
        return self.rank * n_rows_local

    def rows(self, n_rows_local: int, width: int, row_ids: Tensor, device) -> Tensor:
        """Rows `row_ids` (global indices, see `first_row`) of the global noise [n_rows_local * world_size, width],
        for rows scored on another rank than their own (the hierarchical gate's secondary, beside its group).
        The same numbers as __call__(n_tokens_local, width * rows_per_token) with n_rows_local = n_tokens_local *
        rows_per_token: the generator fills row-major either way."""
        return self._global(n_rows_local, width).to(device).index_select(0, row_ids)
