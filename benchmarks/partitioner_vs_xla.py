"""Our partitioner against XLA's on the same annotated programs, in one process.

For each program: max abs difference from the unpartitioned function (both
backends), collectives and payload bytes per device from the compiled HLO
(ours, XLA's, ratio), partition (trace + plan + lower) and compile times, and
the median step time ratio (the two backends timed alternately, so both see
the same machine load). Run:

    python benchmarks/partitioner_vs_xla.py [--devices 8] [--steps 20] [--json out.json]

On a CPU host the devices are simulated (XLA_FLAGS / jax_num_cpu_devices);
on an accelerator host the real devices are used.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices (ignored on accelerators)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per backend")
    p.add_argument("--json", default=None, help="also write the rows as JSON here")
    p.add_argument("--only", default=None, help="comma-separated program names")
    return p.parse_args(argv)


ARGS = parse_args()

import jax  # noqa: E402

# Simulated CPU devices; has no effect on the devices of an accelerator backend.
jax.config.update("jax_num_cpu_devices", ARGS.devices)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import gshard_jax as gs  # noqa: E402
from gshard_jax import configs  # noqa: E402
from gshard_jax.models import cnn, lm  # noqa: E402
from gshard_jax.models.gating import GatingConfig  # noqa: E402
from gshard_jax.models.logical import DEFAULT_RULES  # noqa: E402
from gshard_jax.models.moe import MoeConfig, MoeFFN, expert_einsums  # noqa: E402
from gshard_jax.models.transformer import loss_fn  # noqa: E402
from gshard_jax.partitioner.reporting.hlo import collective_stats  # noqa: E402
from gshard_jax.training import data  # noqa: E402
from gshard_jax.training.timing import median_times  # noqa: E402

# --------------------------------------------------------------------------- programs

def megatron_mlp(x, w1, w2):
    x = gs.shard(x, ("data", None))
    h = jax.nn.gelu(gs.shard(x @ gs.shard(w1, (None, "model")), ("data", "model")))
    return gs.shard(h @ gs.shard(w2, ("model", None)), ("data", None))


def mlp_loss(x, w1, w2):
    return jnp.mean(megatron_mlp(x, w1, w2) ** 2)


def moe_chain(dispatch, combine, x, wi, wo):
    return expert_einsums(dispatch, combine, x, wi, wo, len(jax.devices()))


def moe_loss(dispatch, combine, x, wi, wo):
    return jnp.mean(moe_chain(dispatch, combine, x, wi, wo) ** 2)


def attention(x, wq, wk, wv, wo, heads=8):
    n = len(jax.devices())
    x = gs.split(x, 0, n)
    B, S, D = x.shape
    q = (x @ gs.replicate(wq)).reshape(B, S, heads, D // heads)
    k = (x @ gs.replicate(wk)).reshape(B, S, heads, D // heads)
    v = (x @ gs.replicate(wv)).reshape(B, S, heads, D // heads)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D // heads)
    mask = jnp.arange(S)[:, None] >= jnp.arange(S)[None, :]
    probs = jax.nn.softmax(jnp.where(mask, logits, -1e9), axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(B, S, D)
    return gs.split(x + out @ gs.replicate(wo), 0, n)


def attention_loss(x, wq, wk, wv, wo):
    return jnp.mean(attention(x, wq, wk, wv, wo) ** 2)


def split_attention_loss(p, x, model="model", data="data", heads=8):
    """A Megatron layer whose attention splits a column-split qkv projection with jnp.split."""
    x = gs.shard(x, (data, None, None))
    B, L, D = x.shape
    q, k, v = jnp.split(x @ gs.shard(p["wqkv"], (None, model)), 3, -1)
    split_heads = lambda t: t.reshape(B, L, heads, D // heads)
    s = jnp.einsum("bqhd,bkhd->bhqk", split_heads(q), split_heads(k)) / np.sqrt(D // heads)
    probs = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((L, L), bool)), s, -1e9), -1)
    o = jnp.einsum("bhqk,bkhd->bqhd", probs, split_heads(v)).reshape(B, L, D)
    h = x + o @ gs.shard(p["wo"], (model, None))
    h = h + jax.nn.gelu(h @ gs.shard(p["w1"], (None, model))) @ gs.shard(p["w2"], (model, None))
    return jnp.mean(h ** 2)


def split_attention_step(p, x, data="data"):
    value, g = jax.value_and_grad(lambda p: split_attention_loss(p, x, data=data))(p)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), value


def split_batch(x):
    """Three pieces of a batch split over every device: each piece's blocks straddle the devices'."""
    a, b, c = jnp.split(gs.shard(x, ("batch", None, None)), 3, 0)
    return [gs.shard(t, ("batch", None, None)) for t in (a * b, b + c, c)]


def split_batch_loss(x):
    return sum(jnp.mean(t ** 2) for t in split_batch(x))


def conv_stack(x, *ws):
    """3x3 (or 3x3x3) SAME convolutions with ReLU, the first spatial dim split over every device."""
    spatial = (None, ("data", "model")) + (None,) * (x.ndim - 2)
    dn = ("NHWC", "HWIO", "NHWC") if x.ndim == 4 else ("NDHWC", "DHWIO", "NDHWC")
    for w in ws:
        x = gs.shard(x, spatial)
        x = jax.nn.relu(jax.lax.conv_general_dilated(x, w, (1,) * (x.ndim - 2), "SAME", dimension_numbers=dn))
    return gs.shard(x, spatial)


def conv_loss(x, *ws):
    return jnp.mean(conv_stack(x, *ws) ** 2)


def shift_right(x):
    """An LM's shift right of a sequence split over every device."""
    seq = (None, ("data", "model"), None)
    return gs.shard(jnp.pad(gs.shard(x, seq), ((0, 0), (1, 0), (0, 0)))[:, :-1], seq)


def strided_slice(x):
    """Every other row of a sequence split over every device (a stride-2 downsampling)."""
    seq = (None, ("data", "model"), None)
    return gs.shard(gs.shard(x, seq)[:, ::2], seq)


def programs(n):
    rng = np.random.default_rng(0)
    f32 = lambda *s: np.asarray(rng.standard_normal(s) / np.sqrt(s[-1] if len(s) > 1 else 1), np.float32)
    dp = 2 if n % 2 == 0 and n > 1 else 1
    mp = n // dp
    G, S, E, C, M, H = n, 64, n, 16, 256, 1024
    dispatch = (rng.random((G, S, E, C)) < 2.0 / (E * C)).astype(np.float32)
    combine = dispatch * rng.random((G, S, E, C)).astype(np.float32)
    moe_args = (dispatch, combine, f32(G, S, M), f32(E, M, H), f32(E, H, M))
    mlp_args = (f32(64, 512), f32(512, 2048), f32(2048, 512))
    att_args = (f32(n, 128, 256), f32(256, 256), f32(256, 256), f32(256, 256), f32(256, 256))
    grad = lambda f, k: jax.grad(f, argnums=tuple(range(k)))

    def lm_step(axes, layout, **cfg_kw):
        cfg = lm.LMConfig(**cfg_kw)
        params = lm.init_params(jax.random.key(0), cfg)
        args = (params, lm.optimizer(cfg).init(params), lm.make_batch(jax.random.key(1), 16, cfg))
        step = lambda p, s, b: lm.train_step(p, s, b, cfg, layout)[:3]
        return axes, step, args

    def cnn_step(rules):
        cfg = cnn.CNNConfig()
        model = cnn.ResNet(cfg, rules)
        images, labels = cnn.example_batch(jax.random.key(0), (16, 64, 64, 3), cfg.classes, False)
        params = model.init(jax.random.key(1), images)
        step = lambda p, o, x, y: cnn.train_step(p, o, x, y, model, cfg)
        return {"data": dp, "model": mp}, step, (params, cnn.optimizer(cfg).init(params), images, labels)

    conv2d_args = (f32(4, 256, 64, 16), f32(3, 3, 16, 16), f32(3, 3, 16, 16), f32(3, 3, 16, 16))
    conv3d_args = (f32(2, 64, 32, 32, 4), f32(3, 3, 3, 4, 4), f32(3, 3, 3, 4, 4))
    D = 256
    split_att_args = ({"wqkv": f32(D, 3 * D), "wo": f32(D, D), "w1": f32(D, 4 * D), "w2": f32(4 * D, D)},
                      f32(16, 128, D))
    split_programs = {
        "split_attention train data+model": ({"data": dp, "model": mp}, split_attention_step, split_att_args),
        "split_attention train model": ({"model": n}, lambda p, x: split_attention_step(p, x, data=None),
                                        split_att_args),
        "split_batch fwd": ({"batch": n}, split_batch, (f32(12 * n, 64, 256),)),
        "split_batch grad": ({"batch": n}, jax.grad(split_batch_loss), (f32(12 * n, 64, 256),)),
    }
    conv_programs = {
        "conv2d_stack spatial fwd": ({"data": dp, "model": mp}, conv_stack, conv2d_args),
        "conv2d_stack spatial grad": ({"data": dp, "model": mp}, grad(conv_loss, 4), conv2d_args),
        "conv3d_stack spatial fwd": ({"data": dp, "model": mp}, conv_stack, conv3d_args),
        "conv3d_stack spatial grad": ({"data": dp, "model": mp}, grad(conv_loss, 3), conv3d_args),
        "cnn_train data": cnn_step(cnn.DATA_PARALLEL),
        "cnn_train spatial": cnn_step(cnn.SPATIAL),
        # 250 rows on 8 devices, the weight gradients out (an uneven output would leave our per-device
        # program gathered: shard_map outputs are even)
        "conv2d_stack uneven grad(w)": ({"data": dp, "model": mp}, jax.grad(conv_loss, argnums=(1, 2, 3)),
                                        (f32(4, 250, 64, 16),) + conv2d_args[1:]),
        "shift_right seq": ({"data": dp, "model": mp}, shift_right, (f32(8, 1024, 256),)),
        "strided_slice seq": ({"data": dp, "model": mp}, strided_slice, (f32(8, 1024, 256),)),
    }
    def moe_layer(grad_too):
        """The MoeFFN module (GShard top-2, capacity factor 2), G split over data*expert, E over expert."""
        cfg = MoeConfig(num_experts=n, d_ff=1024, gating=GatingConfig(k=2, second_policy="all"))
        layer = MoeFFN(cfg, DEFAULT_RULES)
        x = jnp.asarray(f32(16, 256, 256))
        params = layer.init(jax.random.key(0), x)
        fwd = lambda p, x: layer.apply(p, x)[0]
        fn = jax.value_and_grad(lambda p, x: jnp.mean(fwd(p, x) ** 2)) if grad_too else fwd
        return {"data": dp, "expert": mp}, fn, (params, x)

    def moe_lm_step():
        """tiny_moe_lm's model and an optax AdamW step, on the same {data, expert} mesh as the MoE layer."""
        exp = configs.load(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                        "experiments", "tiny_moe_lm.py"))
        model = configs.build_model(exp.model)
        tokens = jax.random.randint(jax.random.key(0), (16, 129), 0, exp.model.vocab_size)
        batch = data.model_batch(exp.model.kind, tokens)
        params = model.init(jax.random.key(1), batch["inputs"])
        opt = optax.adamw(1e-3, weight_decay=0.1)

        def step(p, s, b):
            (loss, _), g = jax.value_and_grad(lambda p: loss_fn(model, p, b), has_aux=True)(p)
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s, loss
        return {"data": dp, "expert": mp}, step, (params, opt.init(params), batch)

    lm_programs = {}
    if n % 2 == 0 and n > 1:
        lm_programs["moe_layer fwd"] = moe_layer(False)
        lm_programs["moe_layer grad"] = moe_layer(True)
        lm_programs["tiny_moe_lm train"] = moe_lm_step()
        lm_programs |= {
            "lm_train data": lm_step({"data": n}, lm.Layout("data", None)),
            "lm_train data+model": lm_step({"data": dp, "model": mp}, lm.Layout("data", "model")),
            "lm_train_scan12 data": lm_step({"data": n}, lm.Layout("data", None), scan=True, layers=12),
            "lm_train_scan12 data+model": lm_step({"data": dp, "model": mp}, lm.Layout("data", "model"),
                                                  scan=True, layers=12),
        }
    return {
        "megatron_mlp fwd": ({"data": dp, "model": mp}, megatron_mlp, mlp_args),
        "megatron_mlp grad": ({"data": dp, "model": mp}, grad(mlp_loss, 3), mlp_args),
        "moe_einsum_chain fwd": ({"expert": n}, moe_chain, moe_args),
        "moe_einsum_chain grad": ({"expert": n}, lambda *a: grad(moe_loss, 5)(*a)[2:], moe_args),
        "attention_block fwd": ({"batch": n}, attention, att_args),
        "attention_block grad": ({"batch": n}, grad(attention_loss, 5), att_args),
        **conv_programs,
        **split_programs,
        **lm_programs,
    }


# --------------------------------------------------------------------------- measurement

def build(fn, mesh, args, backend):
    part = gs.partition(fn, mesh, backend=backend)
    t0 = time.perf_counter()
    lowered = part.lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    out = compiled(*args)
    jax.block_until_ready(out)
    return {"compiled": compiled, "out": out, "stats": collective_stats(compiled, per_step=True),
            "partition_s": t1 - t0, "compile_s": t2 - t1}




def max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
               for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def fmt_counts(stats):
    return " ".join(f"{k.replace('collective-permute', 'cp')}:{v['count']}" for k, v in stats.items()
                    if v["count"]) or "none"


def main():
    n = len(jax.devices())
    rows = []
    only = set(ARGS.only.split(",")) if ARGS.only else None
    for name, (axes, fn, args) in programs(n).items():
        if only and name not in only:
            continue
        mesh = gs.make_mesh(axes)
        ref = jax.jit(fn)(*args)
        ours = build(fn, mesh, args, "gshard")
        xla = build(fn, mesh, args, "xla")
        med = median_times({"ours": lambda: ours["compiled"](*args), "xla": lambda: xla["compiled"](*args)},
                           ARGS.steps)
        ours["step_s"], xla["step_s"] = med["ours"], med["xla"]
        ob = sum(v["payload_bytes"] for v in ours["stats"].values())
        xb = sum(v["payload_bytes"] for v in xla["stats"].values())
        oc = sum(v["count"] for v in ours["stats"].values())
        xc = sum(v["count"] for v in xla["stats"].values())
        rows.append({
            "program": name, "mesh": axes, "diff_ours": max_diff(ours["out"], ref),
            "diff_xla": max_diff(xla["out"], ref),
            "collectives_ours": fmt_counts(ours["stats"]), "collectives_xla": fmt_counts(xla["stats"]),
            "count_ours": oc, "count_xla": xc, "bytes_ours": ob, "bytes_xla": xb,
            "bytes_ratio": (ob / xb) if xb else (1.0 if ob == 0 else float("inf")),
            "partition_s_ours": ours["partition_s"], "partition_s_xla": xla["partition_s"],
            "compile_s_ours": ours["compile_s"], "compile_s_xla": xla["compile_s"],
            "step_ms_ours": ours["step_s"] * 1e3, "step_ms_xla": xla["step_s"] * 1e3,
            "step_ratio": ours["step_s"] / xla["step_s"],
            "count_ratio": oc / xc if xc else float(oc == 0) or float("inf"),
            "setup_ratio": (ours["partition_s"] + ours["compile_s"]) / (xla["partition_s"] + xla["compile_s"]),
        })
        print_row(rows[-1], header=len(rows) == 1)
    if ARGS.json:
        with open(ARGS.json, "w") as f:
            json.dump({"backend": jax.default_backend(), "devices": n, "rows": rows}, f, indent=1)
    return rows


def print_row(r, header=False):
    if header:
        print(f"# backend={jax.default_backend()} devices={len(jax.devices())} steps={ARGS.steps}")
        print(f"{'program':<28} {'mesh':<24} {'maxdiff ours/xla':<19} {'collectives ours | xla':<44} "
              f"{'bytes/step ours':>14} {'xla':>10} {'bytes':>6} {'count':>6} {'part s':>13} {'compile s':>13} "
              f"{'setup':>6} {'step ms ours/xla':>17} {'step':>6}")
        print(f"{'':<28} {'':<24} {'':<19} {'':<44} {'':>14} {'':>10} {'ratio':>6} {'ratio':>6} {'':>13} {'':>13} "
              f"{'ratio':>6} {'':>17} {'ratio':>6}")
    print(f"{r['program']:<28} {str(r['mesh']):<24} {r['diff_ours']:.1e}/{r['diff_xla']:.1e}    "
          f"{r['collectives_ours'] + ' | ' + r['collectives_xla']:<44} {r['bytes_ours']:>14,} {r['bytes_xla']:>10,} "
          f"{r['bytes_ratio']:>6.2f} {r['count_ratio']:>6.2f} "
          f"{r['partition_s_ours']:>6.2f}/{r['partition_s_xla']:<6.2f} "
          f"{r['compile_s_ours']:>6.2f}/{r['compile_s_xla']:<6.2f} {r['setup_ratio']:>6.2f} "
          f"{r['step_ms_ours']:>8.2f}/{r['step_ms_xla']:<8.2f} {r['step_ratio']:>6.2f}", flush=True)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
