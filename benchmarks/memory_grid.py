"""The planner's memory per device (its formula, and explain()'s prediction of the planned program) against the
compiled train step's memory_analysis() (argument + output - alias + temp), on 8 simulated CPU devices, over a
grid of the seeds' options: dense and MoE (einsum and dropless), remat none / dots / dots_saveable / full, ZeRO
0-3 and EPSO, microbatches, GPipe / 1F1B / interleaved, context parallelism, offload, scanned and unrolled.

    python benchmarks/memory_grid.py [--cases 0,3,7] [--no-explain] [--json OUT] [--target T] [--hardware P]
        [--bf16 [--held-out [--long] | --experts]] [--seeds]

--target compiles each case for a TPU or GPU target of 8 devices instead (`tpu:v5p:2x2x2`, `gpu:h100:1x1x8`:
gshard_jax/targets; its compiler installed), the formula and explain() then planned for that platform on
--hardware's profile (default: the platform's generic one).

Every case is the experiment file with seq_len 64, batch 32, vocabulary 512, float32, and the overrides listed;
--bf16 takes BF16's shapes instead (the accelerators' grid), --held-out BF16_WIDE's and --long BF16_LONG's;
--experts the EXPERTS cases (dropless MoE at more experts and peers) at BF16's.
--seeds compiles SEEDS, the seeds' own jobs at their scale, each for its own target. benchmarks/fit_habits.py
fits a compiler's row of partitioner/costs/compilers.py to the JSON these write.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

from gshard_jax import configs, targets  # noqa: E402
from gshard_jax.partitioner.costs import hardware  # noqa: E402
from gshard_jax.partitioner.costs.hardware import default_for  # noqa: E402
from gshard_jax.planner import memory_check as MC, space as SP  # noqa: E402
from gshard_jax.training import overrides  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ["train.seq_len=64", "train.batch_size=32", "model.vocab_size=512", "model.dtype=float32"]
# the accelerators' grid (--bf16): bfloat16 steps at sequences where attention's L x L terms count; its held-out
# shapes twice as wide, at twice the sequence and vocabulary
BF16 = ["train.seq_len=512", "train.batch_size=32", "model.vocab_size=2048", "model.dtype=bfloat16"]
BF16_WIDE = ["train.seq_len=1024", "train.batch_size=16", "model.vocab_size=4096", "model.dtype=bfloat16",
             "model.d_model=256", "model.num_heads=8", "model.head_dim=32"]
# and at a long sequence, where attention's L x L values outweigh the rest (--bf16 --held-out --long)
BF16_LONG = ["train.seq_len=2048", "train.batch_size=16", "model.vocab_size=1024", "model.dtype=bfloat16"]
D, M = "tiny_dense_lm", "tiny_moe_lm"
DROPLESS = ["model.moe.dispatch=dropless"]
STAGED = ["model.scan=true"]
# (config, mesh, overrides): the grid, as data
GRID = [
    (D, "data=8", ["model.remat=none"]),
    (D, "data=8", ["model.remat=dots"]),
    (D, "data=8", ["model.remat=dots_saveable"]),
    (D, "data=8", ["model.remat=full"]),
    (D, "data=8", ["model.scan=true", "model.remat=none"]),
    (D, "data=8", ["model.scan=true", "model.remat=dots"]),
    (D, "data=8", ["model.scan=true", "model.remat=full"]),
    (D, "z=8", ["model.scan=true", "model.remat=dots", "train.zero_stage=3"]),
    (D, "data=2,y=4", ["model.remat=none"]),
    (D, "data=8", ["train.zero_stage=1", "train.microbatches=4", "model.remat=dots"]),
    (D, "data=8", ["train.zero_stage=2", "train.microbatches=2"]),
    (D, "data=8", ["train.offload_optimizer=true"]),
    (D, "stage=2,data=4", STAGED + ["pipeline.schedule=1f1b", "train.microbatches=4"]),
    (D, "stage=2,data=4", STAGED + ["pipeline.schedule=gpipe", "train.microbatches=4"]),
    (D, "stage=2,data=4", STAGED + ["pipeline.schedule=interleaved_1f1b", "pipeline.repeats=2",
                                    "train.microbatches=4"]),
    (D, "stage=2,z=2,x=2", STAGED + ["pipeline.schedule=1f1b", "train.microbatches=8", "train.zero_stage=1",
                                     "model.remat=dots"]),
    (D, "data=2,context=4", ["model.remat=none"]),
    (D, "data=8", ["model.scan=true", "train.microbatches=4", "train.zero_stage=1"]),
    (D, "data=2,y=4", ["model.sequence_parallel=true", "model.scan=true", "model.remat=dots"]),
    (D, "data=8", ["model.dtype=bfloat16", "model.scan=true", "model.remat=dots"]),
    (M, "data=2,expert=4", ["model.dtype=bfloat16", "train.zero_stage=1", "train.microbatches=2"]),
    (M, "data=2,expert=4", ["model.remat=none"]),
    (M, "data=2,expert=4", ["model.remat=dots"]),
    (M, "data=2,expert=4", ["model.remat=full"]),
    (M, "data=2,expert=4", ["train.zero_stage=1", "train.microbatches=2", "model.remat=dots"]),
    (M, "data=2,expert=4", ["train.zero_stage=3"]),
    (M, "data=2,expert=4", ["train.zero_stage=2", "train.epso=false"]),
    (M, "data=2,expert=4", DROPLESS + ["model.remat=none"]),
    (M, "data=2,expert=4", DROPLESS + ["model.scan=true", "model.remat=dots"]),
    (M, "stage=2,data=2,expert=2", STAGED + ["pipeline.schedule=1f1b", "train.microbatches=4"]),
    (M, "stage=2,data=2,expert=2", DROPLESS + STAGED + ["pipeline.schedule=1f1b", "train.microbatches=4",
                                                         "train.batch_size=16"]),
]

# Other shapes, to check that the formula's coefficients (planner/memory_model.py, read off GRID) carry over:
# twice the width, twice the sequence, half the batch, twice the vocabulary; 4 experts of 512 units
WIDE = ["train.seq_len=128", "train.batch_size=16", "model.vocab_size=1024", "model.dtype=float32",
        "model.d_model=256", "model.num_heads=8", "model.head_dim=32"]
HELD_OUT = [
    (D, "data=8", ["model.d_ff=1024", "model.remat=none"]),
    (D, "data=8", ["model.d_ff=1024", "model.scan=true", "model.remat=dots"]),
    (D, "data=4,y=2", ["model.d_ff=1024", "model.scan=true", "model.remat=full"]),
    (D, "stage=2,data=4", ["model.d_ff=1024"] + STAGED + ["pipeline.schedule=1f1b", "train.microbatches=4",
                                                          "model.remat=dots"]),
    (D, "stage=2,data=4", ["model.d_ff=1024"] + STAGED + ["pipeline.schedule=gpipe", "train.microbatches=2",
                                                          "model.remat=full"]),
    (M, "data=2,expert=4", ["model.moe.num_experts=4", "model.moe.d_ff=512", "model.scan=true",
                            "model.remat=none"]),
    (M, "data=4,expert=2", ["model.moe.num_experts=4", "model.moe.d_ff=512", "train.zero_stage=1",
                            "train.microbatches=2", "model.remat=dots"]),
]

# Dropless MoE at more experts and peers (--bf16 --experts): its receive buffers grow with the peers, its grouped
# matmuls' weight copies with the local experts, and where the compiler runs a ragged dot densely (XLA:GPU) its
# values with rows x local experts; 1,024 FFN units an expert, so those terms are seen
EXPERT_FFN = ["model.moe.d_ff=1024"]
PIPED = STAGED + ["pipeline.schedule=1f1b", "train.microbatches=4", "train.batch_size=16"]
EXPERTS = [
    (M, "data=2,expert=4", DROPLESS + EXPERT_FFN + ["model.moe.num_experts=32", "model.remat=none"]),
    (M, "expert=8", DROPLESS + EXPERT_FFN + ["model.moe.num_experts=64", "model.remat=none"]),
    (M, "expert=8", DROPLESS + EXPERT_FFN + ["model.moe.num_experts=64", "model.scan=true", "model.remat=dots"]),
    (M, "data=2,expert=4", DROPLESS + EXPERT_FFN + ["model.moe.num_experts=32", "model.moe.peer_bound=2.0",
                                                    "model.remat=none"]),
    (M, "stage=2,data=2,expert=2", DROPLESS + EXPERT_FFN + PIPED + ["model.moe.num_experts=64"]),
    (M, "stage=2,expert=4", DROPLESS + EXPERT_FFN + PIPED + ["model.moe.num_experts=32"]),
    (M, "stage=2,expert=4", DROPLESS + EXPERT_FFN + PIPED + ["model.moe.num_experts=64", "model.remat=full"]),
    (M, "stage=2,expert=4", DROPLESS + EXPERT_FFN + PIPED + ["model.moe.num_experts=32", "model.remat=dots"]),
]

# The seeds' own jobs at their scale (--seeds): (experiment, target[, overrides]), each at the file's own mesh and
# options on the target's devices, as `gshard-jax compile` compiles it
SEEDS = [
    ("gshard_moe_128e_12l", "tpu:v3:8x8"),  # GShard's MoE(128E, 12L) on the paper's 128 TPU v3 cores
    ("gshard_moe_512e_12l", "tpu:v3:16x16"),
    ("gshard_moe_2048e_36l", "tpu:v3:32x32"),  # the paper's 600B model on its 2,048 cores
    ("mula_1b", "gpu:h100:1x1x1"),
    # Mula-100B as its file has it (PP4 x EP12, dropless, remat dots) on 3,072 H100s: no JAX compiler targets
    # Aurora's GPUs; and with remat full, and with its exchange's buffers bounded at twice the mean
    ("mula_100b_a7b", "gpu:h100:1x384x8"),
    ("mula_100b_a7b", "gpu:h100:1x384x8", ["model.remat=full"]),
    ("mula_100b_a7b", "gpu:h100:1x384x8", ["model.moe.peer_bound=2.0"]),
]


def seed_case(i: int):
    """(config, candidate, target) of SEEDS[i] (its overrides applied)."""
    name, target, *extra = SEEDS[i]
    cfg = configs.load(os.path.join(ROOT, "experiments", f"{name}.py"))
    cfg = overrides.apply(cfg, [tuple(kv.split("=", 1)) for kv in (extra[0] if extra else [])])
    return cfg, SP.config_candidate(cfg, targets.parse(target).count), target


def case(i: int, held_out: bool = False, bf16: bool = False, long: bool = False, experts: bool = False):
    """(config, candidate) of grid case i (held_out: of HELD_OUT, at its shapes; bf16: at BF16's, the case's
    own overrides after them, but for its dtype; long: a held-out case at BF16_LONG's; experts: of EXPERTS, at
    BF16's)."""
    name, mesh, extra = (EXPERTS if experts else HELD_OUT if held_out else GRID)[i]
    cfg = configs.load(os.path.join(ROOT, "experiments", f"{name}.py"))
    cfg.mesh.update({a: 1 for a in configs.MeshConfig().sizes()})
    for part in mesh.split(","):
        a, n = part.split("=")
        cfg.mesh[a] = int(n)
    if bf16:
        extra = [kv for kv in extra if not kv.startswith("model.dtype=")]
    base = (BF16_LONG if long else BF16_WIDE if held_out else BF16) if bf16 else WIDE if held_out else BASE
    cfg = overrides.apply(cfg, [tuple(kv.split("=", 1)) for kv in base + extra])
    return cfg, SP.config_candidate(cfg, 8)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="", help="comma-separated grid indices (default: all)")
    p.add_argument("--no-explain", action="store_true", help="leave explain()'s prediction out (faster)")
    p.add_argument("--json", default="", help="write the rows here too")
    p.add_argument("--held-out", action="store_true", help="the HELD_OUT shapes instead of the grid")
    p.add_argument("--bf16", action="store_true", help="every case in bfloat16 at BF16's shapes (seq 512)")
    p.add_argument("--long", action="store_true", help="with --bf16 --held-out: at BF16_LONG's shapes (seq 2048)")
    p.add_argument("--target", default="", help="compile for this target of 8 devices (tpu:v5p:2x2x2, ...)")
    p.add_argument("--hardware", default="", help="the profile the formula and explain() plan on (with --target)")
    p.add_argument("--experts", action="store_true", help="with --bf16: the EXPERTS cases (dropless at scale)")
    p.add_argument("--seeds", action="store_true", help="the SEEDS' jobs at their scale, each for its own target")
    a = p.parse_args()
    table = EXPERTS if a.experts else HELD_OUT if a.held_out else GRID
    want = [int(x) for x in a.cases.split(",") if x] or range(len(table))
    if a.seeds:
        return seeds(want if a.cases else range(len(SEEDS)), a.json)
    devices, hw = None, default_for("cpu")
    if a.target:
        target = targets.parse(a.target)
        devices = target.devices()
        hw = hardware.get(a.hardware) if a.hardware else default_for(target.compiler)
        hw = dataclasses.replace(hw, platform=target.compiler)
    mib = lambda b: "-" if b is None else f"{b / MC.MiB:.2f}"
    ratio = lambda r: "-" if r is None else f"{r:.2f}"
    print("| # | config | candidate | formula MiB | explain() MiB | compiled MiB | formula / compiled | "
          "explain() / compiled |")
    print("| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    rows = []
    for i in want:
        start = time.perf_counter()
        cfg, c = case(i, a.held_out, a.bf16, a.long, a.experts)
        try:
            r = MC.row(cfg, c, hw, explain=not a.no_explain, devices=devices)
        except Exception as e:  # a case that cannot be predicted or compiled is a row that says why
            print(f"| {i} | {table[i][0]} | {c.key} | {type(e).__name__}: {str(e).splitlines()[0][:200]} |||||",
                  flush=True)
            continue
        rows.append(dict(r.to_dict(), case=i, config=table[i][0], held_out=a.held_out, bf16=a.bf16, long=a.long,
                         experts=a.experts,
                         target=a.target, seconds=time.perf_counter() - start))
        print(f"| {i} | {table[i][0]} | {c.key} | {mib(r.formula)} | {mib(r.explained)} | {mib(r.compiled)} | "
              f"{ratio(r.ratio())} | {ratio(r.ratio('explained'))} |", flush=True)
    where = f"{a.target}, planned on {hw.name}" if a.target else f"{len(jax.devices())} x {jax.devices()[0].platform}"
    print(f"jax {jax.__version__}, {where}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


def seeds(want, out: str) -> None:
    """The SEEDS' rows: the formula on the target's platform against the step its compiler compiles."""
    print("| # | config | target | candidate | formula GiB | compiled GiB | formula / compiled |")
    print("| ---: | --- | --- | --- | ---: | ---: | ---: |")
    rows = []
    for i in want:
        start = time.perf_counter()
        t = targets.parse(SEEDS[i][1])
        devices = t.devices()  # before anything starts JAX's backends: XLA:GPU's plugin starts with them
        cfg, c, target = seed_case(i)
        f = MC.formula(cfg, c, t.compiler)
        got = MC.compiled(cfg, c, t.compiler, devices)
        rows.append(dict(seed=i, config=SEEDS[i][0], target=target, key=c.key, overrides=list(SEEDS[i][2:]),
                         formula=f["total"], compiled=got.total, step=got.to_dict(),
                         seconds=time.perf_counter() - start))
        print(f"| {i} | {SEEDS[i][0]} | {target} | {c.key} | {f['total'] / 2**30:.2f} | {got.total / 2**30:.2f} | "
              f"{f['total'] / got.total:.2f} |", flush=True)
    if out:
        with open(out, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    sys.exit(main())
