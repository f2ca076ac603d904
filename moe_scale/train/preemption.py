"""Stop on request, with a checkpoint: SIGTERM (a scheduler's preemption), SIGINT (Ctrl-C) and SIGUSR1 (what SLURM's
`--signal` sends before a job's time runs out) make every rank finish its step, write a complete checkpoint and
exit 0; `--resume` then continues exactly where the run stopped.

A signal can reach the ranks at different steps, so they agree first: after every step each rank adds whether it
has been asked to stop to a sum over all ranks, on the CPU (a gloo group beside NCCL's on GPUs: a GPU step never
waits for it). A second Ctrl-C stops at once, as Ctrl-C usually does (moe_scale/interrupts.py).
"""

from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist

from moe_scale.interrupts import Interrupted

SIGNALS = tuple(s for s in (getattr(signal, name, None) for name in ("SIGTERM", "SIGINT", "SIGUSR1")) if s)


class StopRequests:
    def __init__(self):
        self.received: str | None = None
        self._previous: dict[int, object] = {}
        self._group = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            # collective: every rank creates it (a CPU group even where the default one is NCCL's)
            self._group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
        if threading.current_thread() is threading.main_thread():
            for number in SIGNALS:
                self._previous[number] = signal.signal(number, self._handle)

    def _handle(self, number, frame) -> None:
        if self.received is not None and number == signal.SIGINT:   # pressed again: now
            self.restore()
            raise Interrupted(number)
        self.received = signal.Signals(number).name

    def agreed(self) -> str | None:
        """The signal some rank received (None: carry on); the same answer on every rank."""
        if self._group is None:
            return self.received
        flag = torch.tensor([0 if self.received is None else SIGNALS.index(signal.Signals[self.received]) + 1])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return None if not flag.item() else signal.Signals(SIGNALS[int(flag.item()) - 1]).name

    def end_listening(self) -> None:
        """After the last step: from now on SIGINT and SIGTERM end the command at once (moe_scale/interrupts.py),
        and one that came during the last step's points (its checkpoint is written) ends it now."""
        self.restore()
        if self.received in ("SIGINT", "SIGTERM"):
            raise Interrupted(signal.Signals[self.received])

    def restore(self) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}
