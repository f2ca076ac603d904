"""What training asks of a source of training batches: the loop and its checkpoints use these members and no
others, so every source declares all of them, and one with nothing to do for a member says so trivially.

    LMWindows     (data/batches.py) in memory, epochs of windows; its position is a function of the step
    StreamBatches (data/stream.py)  --stream, one pass; a position of its own, saved in every checkpoint
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class TrainingSource(Protocol):
    # How rows are cut from the text, recorded in every checkpoint (None: the source cuts no rows of its own).
    row_layout: str | None
    # The last step that has a batch, once every rank knows the data ends there (None: no end in sight).
    last_step: int | None
    # Target tokens per whitespace word of the text read (1 for the word vocabulary).
    tokens_per_word: float

    @property
    def steps_per_epoch(self) -> int | None:
        """Steps in one pass over the text (None: one pass only, no epochs)."""

    def describe(self) -> str:
        """What one line of the run's log says about the data."""

    def batch(self, step: int, shuffle_seed: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (inputs_BT, targets_BT) of `step`."""

    def state_dict(self) -> dict | None:
        """The position after the batches read so far, for a checkpoint (None: the step number is all of it)."""

    def load_state_dict(self, state: dict | None) -> None:
        """Continue from what `state_dict` returned when the checkpoint was written."""
