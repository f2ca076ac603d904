#!/usr/bin/env bash
# The GPU check in one command, on one CUDA GPU: the CUDA tests, the MoE layer against DeepSpeed's in bf16, and
# 200-step training runs (LSTM-MoE, transformer MoE LM) with their MFU; one JSON report.
#
#     bash tools/gpu_check.sh [OUT_DIR]          # default gpu_check/; about 15 minutes on an H100
#     QUICK=1 bash tools/gpu_check.sh            # a few minutes: E up to 1024, 50 training steps
#     STEPS=100 EXPERTS=8,256 bash tools/gpu_check.sh   # choose the training steps and the layer's E
#     LAYER_FLAGS=--no-memory bash tools/gpu_check.sh   # more flags for bench_moe_layer.py (here: no memory pass)
#
# Each stage runs under its own time limit (STAGE_TIMEOUT seconds, default 900), so a hung stage still leaves
# the others' results and the report; a stage stopped at its limit prints every thread's Python stack first.
# OUT_DIR/report.json and report.md (tools/gpu_report.py) sum it up; the raw outputs stay beside them.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu_check}
mkdir -p "$out"
export PYTHONFAULTHANDLER=1   # with SIGABRT from timeout: where a hung stage was
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-${TMPDIR:-/tmp}/moe_scale_triton_cache}   # a local disk (DeepSpeed#5205)
timeout -s ABRT 120 python - <<'EOF' > "$out/device.txt" || { echo "gpu_check: no CUDA device (or torch did not import in 2 minutes)" >&2; exit 2; }
import torch
assert torch.cuda.is_available()
p = torch.cuda.get_device_properties(0)
print(f"{p.name}, compute capability {p.major}.{p.minor}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}")
EOF
cat "$out/device.txt"
steps=200; experts=8,64,256,1024,4096
if [ "${QUICK:-0}" = 1 ]; then steps=50; experts=8,64,256,1024; fi
steps=${STEPS:-$steps}; experts=${EXPERTS:-$experts}
limit=(timeout -s ABRT --kill-after=10 "${STAGE_TIMEOUT:-900}")

echo "== CUDA tests"
"${limit[@]}" python -m pytest -q -m gpu tests/gpu --durations=0 --junitxml="$out/tests.xml" 2>&1 | tail -n 30 | tee "$out/tests.txt"

echo "== MoE layer vs DeepSpeed (bf16, 16,384 tokens, d=1024, h=4096, k=2)"
rm -f "$out/layer.jsonl"
"${limit[@]}" python tools/bench_moe_layer.py --device cuda --dtype bfloat16 --experts "$experts" --k 2 --tokens 16384 \
    --d 1024 --h 4096 --impls dropless,deepspeed_dropless,dense --warmup 3 --repeats 10 --min-time 1 \
    ${LAYER_FLAGS:-} --out "$out/layer.jsonl" > "$out/layer.txt" 2>&1 || tail -n 20 "$out/layer.txt"

common=(--max-steps "$steps" --log-interval 25 --eval-interval "$steps" --eval-max-batches 10
        --checkpoint-interval 0 --ds-config ds_configs/gpu_bf16_zero2.json --overwrite)
echo "== LSTM-MoE, $steps steps (d=1024, 64 experts of 4096, k=2, 16,384 tokens per step)"
"${limit[@]}" python -m moe_scale train "${common[@]}" --out "$out/lstm" --d-model 1024 --expert-hidden 4096 \
    --num-experts 64 --top-k 2 --batch-size 512 --seq-len 32 --dropout 0.0 2>&1 | tail -n 25
echo "== transformer MoE LM, $steps steps (d=1024, 8 layers, 64 experts of 2048, k=2, 16,384 tokens per step)"
"${limit[@]}" python -m moe_scale train "${common[@]}" --out "$out/transformer" --model transformer --ffn moe \
    --d-model 1024 --num-layers 8 --num-heads 16 --expert-hidden 2048 --num-experts 64 --top-k 2 \
    --batch-size 16 --seq-len 1024 --dropout 0.0 2>&1 | tail -n 25

echo "== report"
python tools/gpu_report.py "$out"
