"""How many heads each pruning step removes; checked before anything slow is imported (no torch here)."""

from __future__ import annotations

import math

from moe_scale.errors import UserError


def prune_schedule(total_heads: int, fraction_per_step: float, steps: int) -> list[int]:
    """Heads pruned after each step: floor(total · i · fraction) for i = 0 .. steps−1 (the BERT code's int(); the
    MT code's ceil would prune all 8 heads of a small model at 90%)."""
    if not 0 < fraction_per_step < 1:
        raise UserError(f"--fraction-per-step {fraction_per_step}: the pruning fraction must be in (0, 1); "
                        f"0.1 removes 10% of all heads per step")
    if steps < 1:
        raise UserError(f"--steps must be at least 1 (got {steps})")
    last = fraction_per_step * (steps - 1)
    if not 0 <= last < 1:
        raise UserError(f"--steps {steps} x --fraction-per-step {fraction_per_step} reaches a pruned fraction of "
                        f"{last:.2f}; the pruning fraction must stay in [0, 1): lower --steps or the fraction")
    return [math.floor(total_heads * i * fraction_per_step + 1e-9) for i in range(steps)]
