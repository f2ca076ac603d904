"""How many rows each local expert receives, as the dispatcher hands them to the experts (one typed value).

Legend (docs/shapes.md): L local experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch


@dataclass(frozen=True)
class BlockCounts:
    """Rows per block of `block` consecutive experts, on the host: where only those are known without reading the
    device (the hierarchical gate's owner knows its groups' rows, not each expert's), they still place the
    boundaries of calls that split at block edges."""

    block: int
    counts: list[int]


@dataclass(frozen=True)
class ExpertCounts:
    """Rows per local expert: on the device [L] (what grouped GEMMs read), and what the host knows of them without
    reading the device: per expert (`host`, where the dispatcher read them for its all-to-all), per block of experts
    (`blocks`), or nothing."""

    device_L: torch.Tensor
    host: list[int] | None = None
    blocks: BlockCounts | None = None

    @classmethod
    def of(cls, counts: "Counts") -> "ExpertCounts":
        if isinstance(counts, ExpertCounts):
            return counts
        if isinstance(counts, torch.Tensor):
            return cls(counts)
        host = list(counts)
        return cls(torch.tensor(host, dtype=torch.long), host)


# Rows per expert: typed, or simply on the device, or a host list (tests, and callers that have nothing else).
Counts = Union[ExpertCounts, torch.Tensor, list[int]]
