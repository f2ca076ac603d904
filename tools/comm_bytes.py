#!/usr/bin/env python
"""`moe-scale ARGS` with every collective's bytes counted, step by step (tools/bench_vocab_exchange.py runs it).

    deepspeed --num_gpus 2 tools/comm_bytes.py COUNTS_DIR train ...

Each rank writes COUNTS_DIR/rank<r>.json at exit: one entry per optimizer step (from the start of one
`TrainingEngine.backward_and_step` to the start of the next: one step's backward and optimizer, then the next
step's forward), each with the bytes this rank sent by collective ("vocabulary:<collective>" for those of the
vocabulary tables' exchanges, models/vocab_parallel.py) and the vocabulary rows it fetched (the distinct ids of its
batch). Bytes sent by the collectives' usual algorithms: ring
all-reduce 2(n-1)/n of the tensor; all-gather (n-1) x this rank's piece; reduce-scatter (n-1)/n of the input; an
all-to-all what goes to the other ranks; reduce and broadcast the tensor once (the root's share).
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


class Counts:
    def __init__(self):
        self.bytes: Counter = Counter()
        self.rows = 0
        self.steps: list[dict] = []

    def step(self) -> None:
        self.steps.append({"bytes": dict(self.bytes), "rows_fetched": self.rows})
        self.bytes, self.rows = Counter(), 0


_VOCABULARY = "vocabulary:"


def _from_vocabulary() -> bool:
    """Whether the collective was called from the vocabulary tables' exchanges (models/vocab_parallel.py)."""
    frame = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return False
        if frame.f_code.co_filename.endswith("vocab_parallel.py"):
            return True
        frame = frame.f_back
    return False


def _wrap(counts: Counts) -> None:
    """Wraps torch.distributed's collectives (DeepSpeed's comm and moe_scale call them through the module)."""
    import inspect

    import torch.distributed as dist

    def nbytes(t) -> int:
        return t.numel() * t.element_size()

    def counted(name, sent):
        original = getattr(dist, name)
        signature = inspect.signature(original)

        def wrapper(*args, **kwargs):
            bound = signature.bind(*args, **kwargs).arguments
            group = bound.get("group")
            n = dist.get_world_size(group)
            if n > 1:
                counts.bytes[_VOCABULARY + name if _from_vocabulary() else name] += int(sent(n, group, bound))
            return original(*args, **kwargs)
        setattr(dist, name, wrapper)

    def all_to_all_single(n, group, a):
        source, splits = a["input"], a.get("input_split_sizes")
        if not splits:
            return nbytes(source) * (n - 1) / n
        row = nbytes(source) / max(1, source.shape[0])
        return row * (sum(splits) - splits[dist.get_rank(group)])

    counted("all_reduce", lambda n, g, a: 2 * (n - 1) / n * nbytes(a["tensor"]))
    counted("all_to_all_single", all_to_all_single)
    counted("all_gather", lambda n, g, a: (n - 1) * nbytes(a["tensor"]))
    counted("all_gather_into_tensor", lambda n, g, a: (n - 1) * nbytes(a["input_tensor"]))
    counted("reduce_scatter_tensor", lambda n, g, a: (n - 1) / n * nbytes(a["input"]))
    counted("reduce", lambda n, g, a: nbytes(a["tensor"]))
    counted("broadcast", lambda n, g, a: nbytes(a["tensor"]))


def main(argv: list[str]) -> int:
    argv = [a for a in argv if not a.startswith("--local_rank")]   # the deepspeed launcher's, before ours
    if len(argv) < 2:
        print("usage: comm_bytes.py COUNTS_DIR COMMAND ARGS...", file=sys.stderr)
        return 2
    directory, command = Path(argv[0]), argv[1:]
    counts = Counts()
    _wrap(counts)
    import moe_scale.models.vocab_parallel as vocab_parallel
    from moe_scale.train.engine import TrainingEngine

    read_counts = vocab_parallel._read_counts

    def counted_read(t):
        values = read_counts(t)
        if t.dim() == 2:   # an exchange of rows: [what this rank asks of each, what each asks of it]
            counts.rows += sum(values[0])
        return values
    vocab_parallel._read_counts = counted_read

    step = TrainingEngine.backward_and_step

    def marked(self, loss):
        counts.step()
        return step(self, loss)
    TrainingEngine.backward_and_step = marked

    def write() -> None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps({"steps": counts.steps[1:]}))
    atexit.register(write)
    from moe_scale.cli import main as cli_main

    return cli_main(command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
