"""An exchange in pieces, so the experts compute one piece while the next is in flight (--a2a-chunks).

Legend (docs/shapes.md): N tokens on this rank, D model width, R rows that arrive here, L local experts.

A dispatcher's `dispatch_pieces` plans the whole exchange at once (one count exchange and one host read,
whatever the number of pieces: tools/count_step_syncs.py --a2a-chunks) and starts every piece's rows, metadata
and gates on their way (asynchronous all-to-alls with their work handles, moe/dispatch/exchange.py's
`start`); the layer then, piece by piece, lands one, runs its experts, and starts its results back, so piece i's
return and piece i + 1's arrival travel while piece i + 1's experts compute; `combine` lands the returns and adds
each token's results in the order the one-piece dispatch adds them, so the outputs are the same. The backward
overlaps the same way: each landing's backward starts the reverse exchange, which its launch's backward waits for.

Pieces: the counting dispatcher cuts the tokens into C consecutive ranges (a token's pairs all travel in one piece);
capacity's fixed-size slots are cut along each expert's capacity.
"""

from __future__ import annotations

from typing import Iterator, Protocol

import torch

from moe_scale.moe.expert_counts import ExpertCounts


def chunk_bounds(size: int, chunks: int) -> list[tuple[int, int]]:
    """`chunks` consecutive ranges of [0, size), as equal as integers allow (some empty when size < chunks)."""
    edges = [size * c // chunks for c in range(chunks + 1)]
    return list(zip(edges[:-1], edges[1:]))


class Piece(Protocol):
    def land(self) -> tuple[torch.Tensor, ExpertCounts, torch.Tensor | None, torch.Tensor]:
        """(rows [R, D], rows per local expert, each pair's row (None: one pair per row), each pair's gate):
        what the experts take, once the piece has arrived."""

    def start_back(self, per_row_RD: torch.Tensor) -> None:
        """Sends the experts' per-row results back."""


class Pieces(Protocol):
    dropped_pairs: int | torch.Tensor   # copies dropped over all pieces (AllToAllDispatcher.dropped_fraction)
    num_pairs: int

    def __iter__(self) -> Iterator[Piece]: ...

    def combine(self) -> torch.Tensor:
        """[N, D]: every token's results, once every piece is back."""
