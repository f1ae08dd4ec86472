#!/usr/bin/env bash
# Every GPU benchmark case on the GPUs present, with XLA:GPU's overlap flags on and off: our partitioner's
# step against XLA's, tokens/s per device, MFU, memory, and the ragged all-to-alls and collective-permute
# rings each compiled step runs (dropless MoE over the expert axis, collective matmul over y).
#   benchmarks/gpu.sh [STEPS] [extra benchmarks/gpu.py arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
steps="${1:-10}"
shift || true
exec python benchmarks/gpu.py --steps "$steps" \
  --cases tiny_moe_lm,tiny_dense_lm,tiny_moe_lm_dropless,tiny_dense_lm_tp,mula_1b \
  --json "${GSHARD_BENCH_JSON:-gpu_benchmark.json}" "$@"
