#!/usr/bin/env bash
# The GPU check in one call: every stage under its own time limit, its output in OUT as it runs, OUT/summary.json
# rewritten after each stage, so a call cut at any second still returns everything finished before it.
#
#     bash tools/gpu_check.sh OUT                 # one CUDA GPU, no internet: about 7 minutes at most (BUDGET=420)
#     WHEELS=wheels bash tools/gpu_check.sh OUT   # first install what the machine lacks (tools/gpu_wheels.sh)
#     REHEARSE=1 bash tools/gpu_check.sh OUT      # every stage on the CPU at CPU sizes, within 5 minutes
#     STAGES=env,layer bash tools/gpu_check.sh OUT                # only these stages, in this order
#
# Stages, by value (default limits in seconds; the sum is the default BUDGET, 420):
#   env          60  the wheels (WHEELS) installed, the device and the imports, each timed; the check stops here
#                    (exit 2) if torch, a CUDA device, DeepSpeed, datasets or moe_scale is missing
#   tests_bf16   45  tests/gpu in bfloat16: the layer against the CPU float32 reference, the kernels chosen, CUDA's
#                    sync detector on a forward (one host read) and a backward (none)
#   step_syncs   35  tools/count_step_syncs.py (where it exists) on the transformer MoE and the LSTM-MoE
#   layer        60  tools/bench_moe_layer.py: ours against DeepSpeed's MoE and a dense FFN, bfloat16, E = 8, 64, 256,
#                    16,384 tokens, d = 1024, h = 4096, k = 2, layers built on the GPU
#   train       100  60 steps of the transformer MoE (8 layers, d = 1024, 64 experts of 2048, k = 2, 16,384 tokens
#                    per step, ds_configs/gpu_bf16_zero2.json): tokens/s, TFLOPS, MFU
#   tests_fp32   30  tests/gpu in float32: DeepSpeed's Triton grouped GEMM
#   layer_fp32   30  the layer benchmark in float32 (Triton)
#   tests_rest   60  tests/gpu's 20-step training runs (LSTM-MoE first) and its benchmark test
#
# OUT (at most 8 files come back from a lent machine): summary.json (every stage's status ok / failed / timeout /
# skipped, seconds, limit and key numbers; the targets), report.md, log.txt (every stage's output in order and every
# Python process's stacks each STACK_PERIOD seconds), layer.jsonl, layer_fp32.jsonl, step_syncs.jsonl.
# Everything else goes under WORK, on local disk: caches, the installed wheels (py/), and per stage (stages/NAME/,
# new for each run of it; GPU_CHECK_STAGE_<name> commands find it in STAGE_DIR) its log and what it wrote.
#
# Environment: BUDGET (seconds for the whole check), LIMIT_<stage> (seconds), STAGES (comma list), EXPERTS (8,64,256),
# STEPS (60), LAYER_FLAGS, TRAIN_FLAGS, SYNCS_FLAGS (more flags for those tools), TRITON_CONFIGS (autotune
# candidates kept per Triton kernel, default 1; 0 keeps all 6), GPU_TEST_TIMEOUT (seconds for each tests/gpu
# subprocess, default 50), STACK_PERIOD (default 20), WHEELS (default: wheels/ here if it holds wheels), WORK
# (default $TMPDIR/moe_scale_gpu_check), PYTHON (default python3), GPU_CHECK_STAGE_<name> (a command: a stage of
# one's own). Exit status: 0 every stage ok, 1 a stage failed, timed out or found no budget left, 2 the
# environment failed (or a bad setting).
set -uo pipefail
ulimit -c 0   # a 40 GB process killed at its limit must not write a core file
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
[ $# = 1 ] || { echo "gpu_check.sh: error: give the output directory: bash tools/gpu_check.sh OUT" >&2; exit 2; }
mkdir -p "$1" && out=$(cd "$1" && pwd) || { echo "gpu_check.sh: error: cannot create $1" >&2; exit 2; }

export REHEARSE=${REHEARSE:-0}
if [ "$REHEARSE" = 1 ]; then default_budget=300; else default_budget=420; fi
budget=${BUDGET:-$default_budget}
all_stages=env,tests_bf16,step_syncs,layer,train,tests_fp32,layer_fp32,tests_rest
declare -A default_limit=([env]=60 [tests_bf16]=45 [step_syncs]=35 [layer]=60 [train]=100 [tests_fp32]=30
                          [layer_fp32]=30 [tests_rest]=60)
if [ "$REHEARSE" = 1 ]; then   # on a CPU the env stage also compiles what CPU runs build on first use
    default_limit[env]=150 default_limit[layer_fp32]=60
fi
IFS=, read -r -a stages <<< "${STAGES:-$all_stages}"
bad() { echo "gpu_check.sh: error: $*" >&2; exit 2; }
[[ $budget =~ ^[0-9]+$ ]] || bad "BUDGET=$budget: give whole seconds"
for name in "${stages[@]}"; do
    [[ $name =~ ^[A-Za-z0-9_]+$ ]] || bad "stage '$name' in STAGES: letters, digits and _ only"
    custom=GPU_CHECK_STAGE_$name limit_var=LIMIT_$name
    if [ -z "${default_limit[$name]:-}" ] && [ -z "${!custom:-}" ]; then
        bad "unknown stage '$name' in STAGES; choose from $all_stages"
    fi
    [[ ${!limit_var:-0} =~ ^[0-9]+$ ]] || bad "$limit_var=${!limit_var}: give whole seconds"
done

export out repo PY=${PYTHON:-python3}
work=${WORK:-${TMPDIR:-/tmp}/moe_scale_gpu_check}
mkdir -p "$work/stages" && work=$(cd "$work" && pwd) || bad "cannot create the work directory $work"
export work
export wheels=${WHEELS:-}
if [ -z "$wheels" ] && compgen -G "$repo/wheels/*.whl" > /dev/null; then wheels=$repo/wheels; fi

# ---------------------------------------------------------------- guards
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export HF_HOME=$work/hf MOE_SCALE_CACHE=$work/moe_scale TRITON_CACHE_DIR=$work/triton
export TORCHINDUCTOR_CACHE_DIR=$work/inductor TORCH_EXTENSIONS_DIR=$work/torch_extensions
export MPLCONFIGDIR=$work/matplotlib XDG_CACHE_HOME=$work/xdg_cache TRITON_HOME=$work/triton_home
export CUDA_CACHE_PATH=$work/cuda_cache
if [ "$REHEARSE" = 1 ]; then export DS_ACCELERATOR=cpu; else export DS_ACCELERATOR=cuda; fi
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1
export GPU_CHECK_STACKS=$out/log.txt GPU_CHECK_STACK_PERIOD=${STACK_PERIOD:-20}
export PYTHONPATH=$repo/tools/gpu_check_site:$repo${PYTHONPATH:+:$PYTHONPATH}
export MOE_SCALE_GPU_TEST_TIMEOUT=${GPU_TEST_TIMEOUT:-50}
triton_configs=${TRITON_CONFIGS:-1}
[ "$triton_configs" = 0 ] && triton_configs=
export triton_configs EXPERTS=${EXPERTS:-8,64,256} STEPS=${STEPS:-60}
export LAYER_FLAGS=${LAYER_FLAGS:-} TRAIN_FLAGS=${TRAIN_FLAGS:-} SYNCS_FLAGS=${SYNCS_FLAGS:-}

# ---------------------------------------------------------------- the stages (each runs as `bash -c stage_NAME`)
prefix_site() {   # where `pip install --prefix $work/py` put the packages, first on PYTHONPATH
    local d
    for d in "$work"/py/lib*/python3*/{site,dist}-packages "$work"/py/local/lib*/python3*/{site,dist}-packages; do
        [ -d "$d" ] && case ":$PYTHONPATH:" in *":$d:"*) ;; *) PYTHONPATH=$d:$PYTHONPATH ;; esac
    done
    export PYTHONPATH
}

install_wheels() {
    if [ -z "$wheels" ]; then echo "no WHEELS: the packages installed here, as they are"; return 0; fi
    local n flags=(--no-index --find-links "$wheels" --prefix "$work/py" --no-compile --no-cache-dir --timeout 15
                   --retries 0 --no-warn-script-location --progress-bar off)
    [ "$(id -u)" = 0 ] && flags+=(--root-user-action=ignore)
    n=$(compgen -G "$wheels/*.whl" | wc -l)
    echo "installing from $wheels ($n wheels) into $work/py, without an index"
    [ -f "$wheels/requirements.txt" ] && "$PY" -m pip install "${flags[@]}" -r "$wheels/requirements.txt" && return 0
    echo "resolving moe_scale's requirements against what is installed failed: every wheel, without dependencies"
    "$PY" -m pip install "${flags[@]}" --no-deps "$wheels"/*.whl
}

stage_env() {
    command -v nvidia-smi > /dev/null &&
        timeout 15 nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
    install_wheels || return 2
    prefix_site
    "$PY" tools/gpu_env.py "$STAGE_DIR/env.json"
}

gpu_pytest() {   # pytest on tests/gpu, one line per test as it ends (gpu_report.py counts them, also when cut)
    "$PY" -m pytest -v -p no:cacheprovider -m gpu tests/gpu -o addopts="" --durations=5 -rfE "$@"
}
stage_tests_bf16() { gpu_pytest -k "bf16 or kernels_chosen or host_read"; }
stage_tests_fp32() { GPU_CHECK_TRITON_CONFIGS=$triton_configs gpu_pytest -k "fp32"; }
stage_tests_rest() { gpu_pytest -k "twenty_steps or benchmark"; }

stage_step_syncs() {
    local model
    set -o pipefail
    # the step as a GPU dispatches it, simulated on CPU tensors (CUDA's own count: the sync detector in tests_bf16)
    for model in transformer lstm; do
        # shellcheck disable=SC2086
        "$PY" tools/count_step_syncs.py --model "$model" --ds-config ds_configs/gpu_bf16_zero2.json \
            $SYNCS_FLAGS | tee -a "$out/step_syncs.jsonl" || return 1
    done
}

bench_layer() {   # DTYPE JSONL
    local sizes
    if [ "$REHEARSE" = 1 ]; then
        sizes=(--device cpu --experts 8,64 --tokens 1024 --d 64 --h 128 --warmup 1 --repeats 2 --min-time 0)
    else
        sizes=(--device cuda --experts "$EXPERTS" --tokens 16384 --d 1024 --h 4096 --warmup 3 --repeats 10
               --min-time 0.5)
    fi
    # shellcheck disable=SC2086
    GPU_CHECK_TRITON_CONFIGS=$triton_configs "$PY" tools/bench_moe_layer.py "${sizes[@]}" --dtype "$1" --k 2 \
        --impls dropless,deepspeed_dropless,dense --no-memory --out "$2" $LAYER_FLAGS
}
stage_layer() {
    local dtype=bfloat16
    [ "$REHEARSE" = 1 ] && dtype=float32   # bfloat16 on a CPU is another path (F.grouped_mm), not the GPU's
    bench_layer "$dtype" "$out/layer.jsonl"
}
stage_layer_fp32() { bench_layer float32 "$out/layer_fp32.jsonl"; }

stage_train() {
    local shape
    if [ "$REHEARSE" = 1 ]; then
        shape=(--d-model 64 --num-layers 2 --num-heads 4 --expert-hidden 128 --num-experts 8 --batch-size 8
               --seq-len 64)
    else
        shape=(--ds-config ds_configs/gpu_bf16_zero2.json --d-model 1024 --num-layers 8 --num-heads 16
               --expert-hidden 2048 --num-experts 64 --batch-size 16 --seq-len 1024)
    fi
    # shellcheck disable=SC2086
    "$PY" -m moe_scale train --model transformer --ffn moe --top-k 2 --dropout 0.0 "${shape[@]}" --max-steps "$STEPS" \
        --log-interval 20 --eval-interval "$STEPS" --eval-max-batches 2 --checkpoint-interval 0 --overwrite \
        --out "$STAGE_DIR/run" $TRAIN_FLAGS
}
export -f prefix_site install_wheels stage_env gpu_pytest stage_tests_bf16 stage_tests_fp32 stage_tests_rest \
    stage_step_syncs bench_layer stage_layer stage_layer_fp32 stage_train

# ---------------------------------------------------------------- the runner
report() { "$PY" tools/gpu_report.py "$out" "$@" || echo "gpu_check.sh: gpu_report.py $* failed" >&2; }
log() { printf '%s\n' "$@" | tee -a "$out/log.txt"; }
micros() { local t=${EPOCHREALTIME//[.,]/}; echo $((10#$t)); }

: > "$out/log.txt"
rm -f "$out"/{summary.json,report.md} "$out"/*.jsonl
report --start "rehearse=$REHEARSE" "budget_s=$budget" "stages=${stages[*]}" "python=$PY" "wheels=$wheels" \
    "work=$work" "host=$(hostname)" "commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
log "gpu_check: ${stages[*]} within $budget s (REHEARSE=$REHEARSE); output in $out, work files in $work"
status=0 stop=
for name in "${stages[@]}"; do
    if [ -n "$stop" ]; then report --record "$name" skipped 0 --note "$stop"; continue; fi
    limit_var=LIMIT_$name custom=GPU_CHECK_STAGE_$name
    limit=${!limit_var:-${default_limit[$name]:-60}}
    cmd=${!custom:-stage_$name}
    left=$((budget - SECONDS - 3))   # 3 s kept for the last summary
    if [ "$name" = step_syncs ] && [ ! -f tools/count_step_syncs.py ] && [ -z "${!custom:-}" ]; then
        log "== $name: skipped (tools/count_step_syncs.py is not here)"
        report --record "$name" skipped 0 --note "tools/count_step_syncs.py is not here"
        continue
    fi
    if ((left < 3)); then
        log "== $name: skipped (${left} s of the budget left)"
        report --record "$name" skipped 0 --note "budget of $budget s spent"
        status=1
        continue
    fi
    ((limit > left)) && limit=$left
    log "" "== $name (limit $limit s; $SECONDS s of $budget s used) $(date -u +%H:%M:%S)"
    rm -f "$out/$name.jsonl"
    export STAGE_DIR=$work/stages/$name   # what the stage leaves beside OUT, new for every run of it
    rm -rf "$STAGE_DIR" && mkdir -p "$STAGE_DIR" && mkfifo "$STAGE_DIR/.pipe"
    tee -a "$out/log.txt" "$STAGE_DIR/log" < "$STAGE_DIR/.pipe" &
    tee_pid=$!
    start=$(micros)
    timeout -s ABRT -k 5 "$limit" bash -c "$cmd" < /dev/null > "$STAGE_DIR/.pipe" 2>&1
    rc=$?
    # tee ends with the stage's last writer; one that escaped the kill (a new session) must not hold the check
    for _ in $(seq 50); do kill -0 "$tee_pid" 2> /dev/null || break; sleep 0.1; done
    kill "$tee_pid" 2> /dev/null
    seconds=$(( ($(micros) - start) / 1000 ))
    seconds=$((seconds / 1000)).$(printf '%03d' $((seconds % 1000)))
    case $rc in
        0) result=ok ;;
        124|137) result=timeout ;;
        *) result=failed ;;
    esac
    log "== $name: $result after $seconds s (exit status $rc)"
    report --record "$name" "$result" "$seconds" --limit "$limit" --work "$work"
    if [ "$result" != ok ]; then
        status=1
        if [ "$name" = env ]; then stop="the environment failed ($result): nothing later can run"; status=2; fi
    fi
    [ "$name" = env ] && prefix_site   # the later stages see what the env stage installed
done
report --finish "$status" "$SECONDS"
log "" "gpu_check: exit status $status after $SECONDS s"
cat "$out/report.md"
exit "$status"
