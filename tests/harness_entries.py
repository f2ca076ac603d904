"""Entry points for tests/test_harness.py's forked children (module-level, so a child can import them)."""

from __future__ import annotations

import os
import sys
import time


def report_and_exit(argv: list[str]) -> int:
    """Print to stdout through Python and through fd 1 directly, to stderr, then exit with argv[0]."""
    print("python stdout", os.getcwd(), os.environ.get("HARNESS_MARK"), os.getpid())
    sys.stdout.flush()
    os.write(1, b"fd stdout\n")
    os.write(2, b"fd stderr\n")
    os.environ["HARNESS_MARK"] = "changed in the child"
    return int(argv[0])


def sleep_forever(argv: list[str]) -> int:
    while True:
        time.sleep(1)


def raise_error(argv: list[str]) -> int:
    raise RuntimeError("boom")



def report_missing_warm_modules(argv: list[str]) -> int:
    """Print what this child lacks of tests/warm_imports.py's preload (nothing if the server's preload went
    through), without importing anything first."""
    held = set(sys.modules)
    import importlib.util

    from tests import warm_imports

    wanted = ["tests.warm_imports", "moe_scale.train.loop",
              *(name for name in warm_imports.LAZY if importlib.util.find_spec(name.split(".")[0]) is not None)]
    print(" ".join(name for name in wanted if name not in held))
    return 0
