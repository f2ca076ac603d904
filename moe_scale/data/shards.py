"""Shards -> disjoint pieces per reader, and a resumable line reader over a list of pieces.

R readers (ranks x readers per rank) must each read a disjoint part of the data. When the shard count is a
multiple of R, reader r takes shards r, r+R, ...; otherwise every shard is re-split into R byte ranges and
reader r takes range r of every shard. A line belongs to the range in which it starts, so ranges cut at
any byte still give every line to exactly one reader. A reader's position is (piece, byte offset of the
next line): saving it in a checkpoint resumes exactly, without re-reading what was read.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from moe_scale.errors import UserError


@dataclass(frozen=True)
class Piece:
    path: str
    start: int   # first byte (a line starting at or after it belongs here)
    end: int     # lines starting before this byte belong here


def plan_pieces(files: list[Path], num_readers: int) -> list[list[Piece]]:
    """Reader index -> its pieces, in reading order. Empty files are skipped with a logged line."""
    sized = []
    for f in files:
        size = os.path.getsize(f)
        if size == 0:
            print(f"moe-scale: skipping empty shard {f}", file=sys.stderr)
        else:
            sized.append((str(f), size))
    if not sized:
        raise UserError(f"all {len(files)} training shard(s) are empty; provide text with one sentence per line")
    if len(sized) % num_readers == 0:
        return [[Piece(p, 0, size) for p, size in sized[r::num_readers]] for r in range(num_readers)]
    return [[Piece(p, size * r // num_readers, size * (r + 1) // num_readers) for p, size in sized]
            for r in range(num_readers)]


class LineReader:
    """Sentences (stripped, non-empty lines) of a list of pieces, with a saveable position."""

    def __init__(self, pieces: list[Piece]):
        self.pieces = pieces
        self.piece, self.offset = 0, None   # offset None: the current piece has not been opened yet

    def state_dict(self) -> dict:
        return {"piece": self.piece, "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        self.piece, self.offset = state["piece"], state["offset"]

    def __iter__(self) -> Iterator[str]:
        while self.piece < len(self.pieces):
            p = self.pieces[self.piece]
            with open(p.path, "rb") as f:
                if self.offset is None:
                    self.offset = _first_line_start(f, p.start)
                f.seek(self.offset)
                while self.offset < p.end:
                    raw = f.readline()
                    if not raw:
                        break
                    line_offset = self.offset
                    self.offset += len(raw)
                    try:
                        text = raw.decode("utf-8").strip()
                    except UnicodeDecodeError as e:
                        raise UserError(f"{p.path}: not UTF-8 text (invalid byte at offset "
                                        f"{line_offset + e.start}); convert it (e.g. `iconv -f latin1 -t utf-8`) "
                                        f"or remove it from the data") from None
                    if text:
                        yield text
            self.piece, self.offset = self.piece + 1, None


def _first_line_start(f, start: int) -> int:
    """The first line start at or after `start` (a line cut by the range boundary belongs to the range before)."""
    if start == 0:
        return 0
    f.seek(start - 1)
    if f.read(1) == b"\n":
        return start
    f.readline()
    return f.tell()
