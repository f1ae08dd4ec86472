#!/usr/bin/env bash
# The GPU figures docs/training.md reports, in one prepared call on one GPU: benchmarks/gpu_check.py (its
# docstring lists the runs; `--parts`, `--budget-s`, `--report DIR`). On a machine whose JAX is in a virtual
# environment, put that environment's bin first on PATH: the script runs `python`.
#   benchmarks/gpu_check.sh [OUT_DIR] [ANCHOR] [gpu_check.py arguments]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu_check}"
anchor="${2:-../shared/gpu/anchor_lm.py}"
exec "$(command -v python || command -v python3)" benchmarks/gpu_check.py --out "$out" --anchor "$anchor" "${@:3}"
