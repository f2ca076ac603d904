"""Run `moe-scale train` and kill it with SIGKILL at one point of one checkpoint write (a test helper).

    main([STEP, POINT, N, "train", ARGS...])      # in a process of its own: tests.cli_runs.run_cli(entry=main)
    python tests/train/fault_inject.py STEP POINT N train ARGS...

During the save of the checkpoint after step STEP the process kills itself:
  save     inside the N-th torch.save (DeepSpeed's files, then the portable state), after writing half the file
  json     inside the N-th JSON file of the save (layout, manifest, marker), after its temporary file is written
  rename   just before the finished checkpoint directory is renamed from .partial-<tag> to <tag>
  cleanup  halfway through deleting the checkpoint that falls out of the newest two (after the marker moved on)
Nothing in moe_scale knows about this: the helper wraps library functions from outside, as a crash would find them.
"""

from __future__ import annotations

import io
import os
import signal
import sys
from pathlib import Path


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str]) -> int:
    step, point, nth = int(argv[0]), argv[1], int(argv[2])
    import torch

    import moe_scale.files as files
    import moe_scale.train.checkpoint as checkpoint
    import moe_scale.train.loop as loop

    armed, calls = [False], [0]

    def counted() -> bool:
        if armed[0]:
            calls[0] += 1
        return armed[0] and calls[0] == nth

    real_save_checkpoint = loop.save_checkpoint

    def save_checkpoint(engine, run, state, *args, **kwargs):
        armed[0] = state.step == step
        real_save_checkpoint(engine, run, state, *args, **kwargs)
        armed[0] = False

    loop.save_checkpoint = save_checkpoint

    if point == "save":
        real_torch_save = torch.save

        def torch_save(obj, f, *args, **kwargs):
            if counted() and isinstance(f, (str, os.PathLike)):
                buffer = io.BytesIO()
                real_torch_save(obj, buffer, *args, **kwargs)
                Path(f).write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
                _die()
            return real_torch_save(obj, f, *args, **kwargs)

        torch.save = torch_save
    elif point == "json":
        real_replace = os.replace

        def replace(src, dst, *args, **kwargs):   # files.write_text_atomic's rename of its temporary file
            if files._TMP in Path(src).name and counted():
                _die()
            return real_replace(src, dst, *args, **kwargs)

        files.os.replace = replace
    elif point == "rename":
        real_path_replace = Path.replace

        def path_replace(self, target):
            if self.name.startswith(".partial-") and counted():
                _die()
            return real_path_replace(self, target)

        Path.replace = path_replace
    elif point == "cleanup":
        real_rmtree = checkpoint.shutil.rmtree

        def rmtree(path, *args, **kwargs):
            if Path(path).name.startswith("step") and counted():
                victims = sorted(p for p in Path(path).rglob("*") if p.is_file())
                for victim in victims[: len(victims) // 2]:
                    victim.unlink()
                _die()
            return real_rmtree(path, *args, **kwargs)

        checkpoint.shutil.rmtree = rmtree
    else:
        raise SystemExit(f"unknown point {point}")

    from moe_scale.cli import main as cli_main

    return cli_main(argv[3:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
