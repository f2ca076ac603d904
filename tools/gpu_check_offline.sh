#!/usr/bin/env bash
# tools/gpu_check.sh on a GPU node without internet access (air-gapped clusters): the Python packages it lacks
# come as wheels, are installed into a private directory (the node's own Python and torch are left alone),
# every step runs under a time limit, and the whole output is packed into one tarball to copy back.
#
#     # where pip works, for the node's Python (e.g. 3.12; DeepSpeed ships a source archive: build its wheel):
#     pip wheel --no-deps deepspeed==0.19.8 -w wheels
#     pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux2014_x86_64 -d wheels hjson pydantic pydantic_core annotated-types \
#         typing-inspection datasets dill multiprocess      # what the node lacks of moe_scale's dependencies
#     # on the node, in the repository:
#     bash tools/gpu_check_offline.sh wheels OUT_DIR      # OUT_DIR/gpu_check.tgz, OUT_DIR/report.md
#
# Environment: STEPS, EXPERTS, LAYER_FLAGS, STAGE_TIMEOUT as for gpu_check.sh; TOTAL (seconds, default 3000)
# bounds the whole check so that the tarball is always written.
set -uo pipefail
wheels=${1:?usage: gpu_check_offline.sh WHEEL_DIR [OUT_DIR]}
out=${2:-gpu_check_offline}
cd "$(dirname "$0")/.."
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$work/site" "$wheels"/*.whl \
    || { echo "gpu_check_offline: installing the wheels from $wheels failed" >&2; exit 2; }
export PYTHONPATH=$PWD:$work/site PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
export TRITON_CACHE_DIR=$work/triton   # a local disk: DeepSpeed's Triton autotune cache locks (DeepSpeed#5205)
if ! command -v python > /dev/null; then   # a wrapper, not a link: a virtual environment's python3 finds its packages
    mkdir -p "$work/bin" && printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v python3)" > "$work/bin/python"
    chmod +x "$work/bin/python" && export PATH=$work/bin:$PATH
fi
# the imports alone first, with a limit: a hang here would otherwise eat the whole check
timeout -s ABRT 300 python - <<'EOF' 2>&1 | tee "$out/environment.txt"
import importlib, time
for name in ("torch", "triton", "deepspeed", "datasets", "tokenizers", "transformers", "moe_scale"):
    start = time.perf_counter()
    try:
        module = importlib.import_module(name)
        print(f"{name} {getattr(module, '__version__', '')} ({time.perf_counter() - start:.1f} s)", flush=True)
    except Exception as e:
        print(f"{name}: {e!r}", flush=True)
import torch, torch.nn.functional as F
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else "",
      "F.grouped_mm", hasattr(F, "grouped_mm"), "torch._grouped_mm", hasattr(torch, "_grouped_mm"), flush=True)
EOF
[ "${PIPESTATUS[0]}" = 0 ] || { echo "gpu_check_offline: the imports failed or hung (stacks above)" >&2; exit 2; }
timeout -s ABRT --kill-after=10 "${TOTAL:-3000}" bash tools/gpu_check.sh "$work/gc" 2>&1 | tee "$out/gpu_check.log"
find "$work/gc" \( -name '*.pt' -o -name 'events.out*' \) -size +2M -delete 2>/dev/null
cp "$work/gc/report.md" "$work/gc/report.json" "$out/" 2>/dev/null
tar czf "$out/gpu_check.tgz" -C "$work" gc
echo "gpu_check_offline: $out/gpu_check.tgz"
