#!/usr/bin/env bash
# The GPU figures docs/training.md reports, in one call on one GPU (4 minutes on an H200 before the host
# update, group and trace rows; about 7 with them, estimated): the plain-JAX anchor (../shared/gpu/anchor_lm.py)
# and our Mula-1B step (benchmarks/gpu.py: ours against XLA's partitioner, the config's scanned layers, and
# unrolled as the anchor is) with einsum and cuDNN attention, remat dots and none, the optimizer offloaded (on
# 4 layers, with and without the delayed update, in 1 and 8 host groups), the unrolled step traced beside the
# anchor's (benchmarks/gpu_profile.py), and the planner's compute efficiency and host-update bandwidth
# calibrated on one remat policy and checked on the other. On a machine whose JAX is in a virtual
# environment, put that environment's bin first on PATH: the script runs `python`. Each step's files are
# written as it ends, so a call cut short keeps what finished.
#   benchmarks/gpu_check.sh [OUT_DIR] [ANCHOR]
# Rows go to OUT_DIR (default .): anchor.jsonl, ours_*.json, host_update.txt, profile.txt, calibrated.json and
# calibrate.json.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-.}"
anchor="${2:-../shared/gpu/anchor_lm.py}"
mkdir -p "$out"
status=0
step() { echo "== $*" >&2; "$@" || status=1; }

# the project's flops per token for Mula-1B at 2,048 tokens, and the device's peak: the anchor's MFU is ours
read -r flops peak < <(python - <<'EOF'
import jax
from gshard_jax import configs
from gshard_jax.partitioner import hardware
cfg = configs.load("experiments/mula_1b.py")
cfg.train.seq_len = 2048
hw = hardware.for_device(jax.devices()[0].device_kind)
print(int(configs.model_flops_per_token(cfg)), hw.peak_flops if hw else 989e12)
EOF
)
if [ -f "$anchor" ]; then
  step python "$anchor" --flops-per-token "$flops" --peak "$peak" \
    --variants einsum:dots,einsum:none,cudnn:dots,cudnn:none | tee "$out/anchor.jsonl"
else
  echo "no anchor at $anchor: pass its path as the second argument" >&2
  status=1
fi
# einsum attention under dots_saveable: the anchor's "dots" is checkpoint_dots, which keeps the batched score
# matmuls our "dots" recomputes (docs/training.md); with cuDNN's kernel (not a matmul) the two keep the same.
for variant in "cudnn dots false true" "einsum dots_saveable false true" "cudnn none false true" \
    "cudnn dots false false"; do
  read -r attention remat offload scan <<<"$variant"
  step python benchmarks/gpu.py --steps 10 --cases mula_1b --flags on \
    --set "model.attention=$attention" "model.remat=$remat" "train.offload_optimizer=$offload" "model.scan=$scan" \
    --json "$out/ours_${attention}_${remat}_offload_${offload}_scan_${scan}.json"
done
# What the host's cores give an AdamW update (XLA:CPU one leaf and 8, numpy on one thread and on every core).
step python benchmarks/host_update.py | tee "$out/host_update.txt"
# The offloaded update on 4 of Mula-1B's 16 layers (the whole model's host update takes most of a second a
# step): on the device, offloaded, and offloaded with the delayed update (the host beside the device's step),
# the host's update as one computation and as 8 (train.host_update_groups: XLA:GPU's host threads).
for variant in "false false 1" "true false 1" "true true 1" "true false 8" "true true 8"; do
  read -r offload delayed groups <<<"$variant"
  step python benchmarks/gpu.py --steps 4 --cases mula_1b --flags on \
    --set "model.attention=cudnn" "model.remat=dots" "model.num_layers=4" "train.offload_optimizer=$offload" \
    "train.delayed_update=$delayed" "train.host_update_groups=$groups" \
    --json "$out/ours_4_layers_offload_${offload}_delayed_${delayed}_groups_${groups}.json"
done
# Where the unrolled step's time beyond its kernels goes, ours and the anchor's: kernels a step, launch gaps
# and waits on the stream (the traces stay out of OUT_DIR: tens of MB each).
if [ -f "$anchor" ]; then
  step python benchmarks/gpu_profile.py --anchor "$anchor" --variants cudnn:dots --set model.scan=false \
    --out "$(mktemp -d)" | tee "$out/profile.txt"
fi
work="$(mktemp -d)"
step python -m gshard_jax.cli calibrate --config experiments/mula_1b.py --workdir "$work" \
  --out "$out/calibrated.json" --config.train.batch_size=4 --config.train.seq_len=2048 \
  --config.model.attention=cudnn --config.model.remat=none --check model.remat=dots --json \
  | tee "$out/calibrate.json"
exit "$status"
