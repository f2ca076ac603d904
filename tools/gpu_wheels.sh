#!/usr/bin/env bash
# The wheels that tools/gpu_check.sh installs on a GPU machine without internet (CPython 3.12, manylinux x86_64),
# built and fetched here from PyPI; tools/gpu_wheels.py says how they are chosen.
#
#     bash tools/gpu_wheels.sh wheels            # what the lent image lacks (tools/gpu_image.txt): a few MB
#     bash tools/gpu_wheels.sh wheels --full     # everything but torch, triton and CUDA's libraries
#     bash tools/gpu_wheels.sh wheels --check    # then install them into a Python 3.12 here, no index, and import
#
# wheels/ in the repository is ignored by git and travels with the working tree to a lent machine, where
# tools/gpu_check.sh installs it (or WHEELS=DIR names another). Downloads are kept in WHEELS_CACHE (default
# $TMPDIR/moe_scale_wheels); DEEPSPEED_VERSION (0.19.8), PYTHON312 (python3.12) for --check.
set -euo pipefail
exec python3 "$(dirname "$0")/gpu_wheels.py" "$@"
