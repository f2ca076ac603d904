"""The Triton grouped-GEMM kernel (A100s; float32 and float16 on any GPU) checked on CPU:
tests/moe/triton_interpreted.py runs DeepSpeed's kernels in Triton's interpreter, in a child process, against
torch's F.grouped_mm (the products, and the MoE layer's forward and every gradient, flat and hierarchical gates)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.paths import REPO

CHECK = Path(__file__).with_name("triton_interpreted.py")


# Size: Triton's interpreter runs each kernel instance in Python: the two tile sizes are the two cases (an expert
# over several tiles, within one), at the fewest rows that make them.
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (pip install triton)")
@pytest.mark.parametrize("config", [0, 5], ids=["tiles-32x128", "tiles-128x256"])
def test_triton_kernel_matches_grouped_mm_in_the_interpreter(config):
    """Tile sizes from either end of DeepSpeed's autotune list: an expert's rows over several tiles (32 rows),
    and within one (128 rows)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_CONFIG": str(config), "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(CHECK)], capture_output=True, text=True, timeout=300, env=env,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "products and layers match F.grouped_mm" in proc.stderr
