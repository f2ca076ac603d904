"""A stand-in for the data-parallel group in one process: what a rank's router would get from `batch.sum`."""

from moe_scale.distributed.comm import BatchCollectives


class SumWith(BatchCollectives):
    """`batch.sum(t)` is `fn(t)` (e.g. t + another rank's statistics, or a spy that records its calls)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def sum(self, t):
        return self.fn(t)
