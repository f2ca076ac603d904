#!/usr/bin/env bash
# One device call: environment, ceilings, then tools/gpu_check.sh; everything packed into $OUT.
set -o pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site
mkdir -p /tmp/bin && printf "#!/bin/sh\nexec %s \"\$@\"\n" "$(command -v python3)" > /tmp/bin/python && chmod +x /tmp/bin/python && export PATH=/tmp/bin:$PATH
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.max.sm --format=csv
python - <<'PY'
import torch, torch.nn.functional as F, deepspeed, datasets
try:
    import triton; tv = triton.__version__
except Exception as e: tv = repr(e)
print("torch", torch.__version__, "F.grouped_mm", hasattr(F, "grouped_mm"), "_grouped_mm", hasattr(torch, "_grouped_mm"),
      "deepspeed", deepspeed.__version__, "datasets", datasets.__version__, "triton", tv, flush=True)
from triton.testing import do_bench
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16); b = torch.randn_like(a)
t = do_bench(lambda: a @ b, warmup=100, rep=500, return_mode="median")
print(f"ceiling: bf16 8192^3 matmul {2 * 8192**3 / t / 1e9:.0f} TFLOP/s")
x = torch.empty(2**31, dtype=torch.uint8, device="cuda").random_(); y = torch.empty_like(x)
t = do_bench(lambda: y.copy_(x), warmup=50, rep=300, return_mode="median")
print(f"ceiling: device copy {2 * x.numel() / t / 1e6:.0f} GB/s (read + write)")
PY
STAGE_TIMEOUT=${STAGE_TIMEOUT:-170} STEPS=${STEPS:-200} LAYER_FLAGS=${LAYER_FLAGS:---no-memory} \
    timeout --kill-after=5 ${TOTAL:-520} bash tools/gpu_check.sh /tmp/gc 2>&1 | tee /tmp/gc_log.txt
find /tmp/gc -name '*.pt' -delete; find /tmp/gc -name 'events.out*' -size +2M -delete
tar czf "$OUT/gc.tgz" -C /tmp gc gc_log.txt
cp /tmp/gc/report.md /tmp/gc/report.json /tmp/gc/layer.jsonl "$OUT/" 2>/dev/null
ls -la "$OUT"
