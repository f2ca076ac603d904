"""What the training loop measures, kept on the device between log points so that a GPU step never waits.

    PendingSteps  each step's [NLL sum, tokens, aux sum] and gradient norm stay device tensors; `flush`
                  reads every pending step to the host in one copy and returns the records of train_log.jsonl
    StepTimer     wall time and all-to-all time of training steps, excluding evaluation and checkpoints; on a
                  GPU it synchronises only where a timing window starts and stops (log, evaluation and
                  checkpoint boundaries), never per step
"""

from __future__ import annotations

import time
from typing import Callable

import torch


class PendingSteps:
    def __init__(self):
        self._steps: list[tuple[int, float, torch.Tensor, object]] = []

    def add(self, step: int, lr: float, sums_3: torch.Tensor, grad_norm) -> None:
        """`sums_3`: [NLL sum, tokens, aux-loss sum] of the step over all ranks (float64, any device);
        `grad_norm`: a tensor, a float or None, as the engine reports it."""
        self._steps.append((step, lr, sums_3.detach(), grad_norm))

    def __len__(self) -> int:
        return len(self._steps)

    def flush(self, micro_batches: int) -> list[dict]:
        """Records {step, loss, aux_loss, grad_norm, lr} of the pending steps, read in one device-to-host copy.
        `micro_batches`: aux-loss terms summed per step (ranks x gradient accumulation)."""
        if not self._steps:
            return []
        device = self._steps[0][2].device
        norms = [torch.as_tensor(float("nan") if norm is None else norm, dtype=torch.float64, device=device)
                 .detach().reshape(()) for _, _, _, norm in self._steps]
        values = torch.cat([torch.stack([sums for _, _, sums, _ in self._steps]),
                            torch.stack(norms).to(device)[:, None]], dim=1).tolist()
        records = [{"step": step, "loss": nll / tokens, "aux_loss": aux / micro_batches,
                    "grad_norm": None if given is None else norm, "lr": lr}
                   for (step, lr, _, given), (nll, tokens, aux, norm) in zip(self._steps, values)]
        self._steps = []
        return records


class StepTimer:
    def __init__(self, device: torch.device, comm_seconds: Callable[[], float]):
        self.device, self._comm = device, comm_seconds
        self.running = False
        self.total = {"seconds": 0.0, "all_to_all": 0.0, "steps": 0}
        self.interval = dict(self.total)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        if self.running:
            return
        self._sync()
        self.running, self._steps = True, 0
        self._began, self._comm_began = time.perf_counter(), self._comm()

    def step_done(self) -> None:
        if self.running:
            self._steps += 1

    def stop(self) -> None:
        if not self.running:
            return
        self._sync()
        seconds, comm = time.perf_counter() - self._began, self._comm() - self._comm_began
        for totals in (self.total, self.interval):
            totals["seconds"] += seconds
            totals["all_to_all"] += comm
            totals["steps"] += self._steps
        self.running = False

    def take_interval(self) -> dict:
        """The totals since the last call (stop the timer first)."""
        interval, self.interval = self.interval, {"seconds": 0.0, "all_to_all": 0.0, "steps": 0}
        return interval
