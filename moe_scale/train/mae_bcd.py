"""MAE's training schedule (Peng et al. 2020, Alg. 1-3; spec §4.3): block coordinate descent or joint training.

- `--mae-training bcd`: the gate parameters φ are outside DeepSpeed's optimizer (requires_grad off). On a
  G-step batch (one epoch — or step, `--mae-g-unit` — in every `--mae-g-every`, counted from 0), a G step
  runs first: the mixture forward, gradients for φ only (torch.autograd.grad, so no other gradient is touched),
  averaged over the data-parallel ranks, one plain-SGD step with `--mae-gate-lr` (no momentum: the paper saw
  momentum make the gate collapse). Every batch then takes the F step through the engine: each layer samples
  one expert per token from the gate (no gradient) and everything but φ is updated.
- `--mae-training joint` (the NoBCD ablation): the mixture forward always, φ in the optimizer with the rest.

Evaluation always uses the gate-weighted mixture (the layers switch to it in eval mode).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe_scale.attention.mae import MAEAttention
from moe_scale.config import RunConfig
from moe_scale.distributed.comm import collective_device


class MAEBlockCoordinateDescent:
    def __init__(self, model: torch.nn.Module, config: RunConfig, steps_per_epoch: int):
        mae = config.attention.mae
        self.model, self.grad_accum = model, config.train.grad_accum
        self.layers = [module for module in model.modules() if isinstance(module, MAEAttention)]
        self.gate_params = [p for layer in self.layers for p in layer.gate_parameters()]
        self.every, self.lr = mae.g_every, mae.gate_lr
        self.unit_steps = steps_per_epoch if mae.g_unit == "epoch" else 1
        for p in self.gate_params:      # out of the engine's optimizer groups
            p.requires_grad_(False)
        self._set_mode("sample")

    def is_g_step(self, step: int) -> bool:
        return (step // self.unit_steps) % self.every == 0

    def g_step_if_due(self, step: int, inputs: torch.Tensor, targets: torch.Tensor, device) -> bool:
        """Runs the G step of this batch when the schedule says so; leaves the layers in F-step mode."""
        if not self.is_g_step(step):
            return False
        self._set_mode("mixture")
        for p in self.gate_params:
            p.requires_grad_(True)
        grads = [torch.zeros_like(p) for p in self.gate_params]
        for micro_inputs, micro_targets in zip(inputs.chunk(self.grad_accum), targets.chunk(self.grad_accum)):
            out = self.model(micro_inputs.to(device), micro_targets.to(device))
            loss = (out.nll_sum / out.num_tokens + out.aux_loss) / self.grad_accum
            for total, grad in zip(grads, torch.autograd.grad(loss, self.gate_params, allow_unused=True)):
                if grad is not None:
                    total += grad
        _average_over_ranks(grads)
        with torch.no_grad():
            for p, grad in zip(self.gate_params, grads):
                p -= self.lr * grad
                p.requires_grad_(False)
        self._set_mode("sample")
        return True

    def _set_mode(self, mode: str) -> None:
        for layer in self.layers:
            layer.mode = mode


def _average_over_ranks(grads: list[torch.Tensor]) -> None:
    if not (dist.is_initialized() and dist.get_world_size() > 1) or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads]).to(collective_device())
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g).to(g.device))
        offset += g.numel()


def mae_schedule(model: torch.nn.Module, config: RunConfig,
                 steps_per_epoch: int | None) -> MAEBlockCoordinateDescent | None:
    """The BCD driver for an MAE model trained with `--mae-training bcd`, else None (joint: nothing to do).
    Call before the engine is built (it takes the gate out of the optimizer). `steps_per_epoch` is None for
    streamed data (one pass, no epochs; the config refuses --mae-g-unit epoch with --stream)."""
    if config.model.kind != "transformer" or config.attention.kind != "mae" or config.attention.mae.training != "bcd":
        return None
    return MAEBlockCoordinateDescent(model, config, steps_per_epoch)
