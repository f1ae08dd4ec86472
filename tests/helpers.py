"""Shared test helpers: random arrays, random shardings, HLO collective counts, the repository's scripts."""
from __future__ import annotations

import contextlib
import importlib.util
import itertools
import math
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import primitives as _primitives
from jax.interpreters import mlir

import gshard_jax as gs
from gshard_jax.partitioner.reporting.hlo import collective_stats, summary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_script(*path: str):
    """A script of the repository (examples/, benchmarks/) as a module, by its path under the root: scripts
    are not packages, and importing one runs nothing its `__main__` guard keeps."""
    name = os.path.splitext(path[-1])[0] + "_script"
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, *path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their string annotations through the module's entry
    spec.loader.exec_module(module)
    return module


def randn(rng, *shape, dtype=np.float32):
    return np.asarray(rng.standard_normal(shape), dtype)


def all_specs(shape, mesh, uneven=False):
    """Every PartitionSpec-tuple that splits `shape` over distinct axes of `mesh` (axes in any order).

    Evenly only, unless uneven=True: then any split with at least one element per tile.
    """
    names = list(mesh.axis_names)
    sizes = dict(mesh.shape)
    out = []
    for targets in itertools.product(range(len(shape) + 1), repeat=len(names)):
        for perm in itertools.permutations(names):
            dims = [tuple(a for a in perm if targets[names.index(a)] == d) for d in range(len(shape))]
            tiles = [math.prod(sizes[a] for a in dims[d]) for d in range(len(shape))]
            if all(shape[d] % t == 0 or (uneven and shape[d] >= t) for d, t in enumerate(tiles)):
                spec = tuple(None if not d else d for d in dims)
                if spec not in out:
                    out.append(spec)
    return out


_DOT_GENERAL = re.compile(r"stablehlo\.dot_general.*?contracting_dims = \[([\d, ]*)\] x .*?"
                          r": \(tensor<([^>]*)>, tensor<[^>]*>\) -> tensor<([^>]*)>")


def matmul_flops(lowered_text: str) -> int:
    """Flops of every dot_general in a lowered (StableHLO) module: 2 x output elements x contracted size.
    The lowered module is what the step asks for, remat's recomputation included (and kept apart by
    optimization barriers where the layers are not scanned)."""
    def dims(t):
        return [int(d) for d in t.split("x")[:-1]]
    found = _DOT_GENERAL.findall(lowered_text)
    assert len(found) == lowered_text.count("stablehlo.dot_general"), "a dot_general the pattern did not read"
    total = 0
    for contracting, lhs, out in found:
        lhs_dims = dims(lhs)
        total += 2 * math.prod(dims(out)) * math.prod(lhs_dims[int(i)] for i in contracting.split(",") if i.strip())
    return total


def hlo_counts(jitted, *args) -> dict:
    return summary(collective_stats(jitted.lower(*args).compile()))


def hlo_stats(jitted, *args) -> dict:
    return collective_stats(jitted.lower(*args).compile())


def assert_report_matches_hlo(report, stats) -> None:
    """explain() tells the whole truth: per kind, the same count and payload bytes as the compiled HLO."""
    predicted = report.totals()
    for kind in predicted:
        assert (predicted[kind]["count"], predicted[kind]["payload_bytes"]) == \
            (stats[kind]["count"], stats[kind]["payload_bytes"]), (kind, predicted, stats)


def assert_per_step_matches_hlo(report, compiled) -> None:
    """explain()'s totals per step (loops times their trips) equal the compiled program's, per kind."""
    predicted = report.totals(dynamic=True)
    stats = collective_stats(compiled, per_step=True)
    for kind in predicted:
        assert (predicted[kind]["count"], predicted[kind]["payload_bytes"]) == \
            (stats[kind]["count"], stats[kind]["payload_bytes"]), (kind, predicted, stats)


def assert_close(a, b, rtol=1e-5, atol=1e-5):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


_MESHES: dict = {}


def get_mesh(name):
    """A cached mesh from conftest.MESHES by name ("8", "2x4", "2x2x2")."""
    from conftest import MESHES
    if name not in _MESHES:
        _MESHES[name] = gs.make_mesh(MESHES[name])
    return _MESHES[name]


def check(fn, args, mesh, seed, n=6, out_random=True, rtol=1e-5, atol=1e-5, arg_specs=None, uneven=False):
    """Run fn with random input/output shardings n times; each must equal the unpartitioned result.

    arg_specs: optional per-argument list of allowed specs (default: every even spec, or with
    uneven=True every spec with at least one element per tile).
    """
    import random
    want = fn(*args)
    r = random.Random(seed)
    for _ in range(n):
        in_specs = [r.choice(arg_specs[i] if arg_specs and arg_specs[i] is not None
                             else all_specs(np.shape(a), mesh, uneven)) for i, a in enumerate(args)]
        outs = jax.tree_util.tree_leaves(want)
        out_specs = [r.choice(all_specs(np.shape(o), mesh, uneven)) for o in outs] if out_random else None

        def annotated(*xs):
            y = fn(*[gs.shard(x, s) if np.ndim(x) else x for x, s in zip(xs, in_specs)])
            if out_specs is None:
                return y
            leaves, tree = jax.tree_util.tree_flatten(y)
            return jax.tree_util.tree_unflatten(tree, [gs.shard(v, s) for v, s in zip(leaves, out_specs)])

        got = gs.partition(annotated, mesh)(*args)
        assert_close(got, want, rtol=rtol, atol=atol)


__all__ = ["randn", "all_specs", "hlo_counts", "hlo_stats", "assert_close", "assert_report_matches_hlo", "check",
           "get_mesh", "gs"]


def flax_optax_step(batch: int, features: int, hidden: int, classes: int):
    """Library code nobody here wrote: a Flax linen MLP (Dense, gelu, LayerNorm) trained by optax's adamw on
    optax's cross-entropy, its batch split over `data`. (step, abstract args): step(params, opt_state, x, y)
    -> (params, opt_state, loss)."""
    import flax.linen as nn
    import jax.numpy as jnp
    import optax

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(classes)(nn.LayerNorm()(nn.gelu(nn.Dense(hidden)(x))))

    model, opt = MLP(), optax.adamw(1e-3)
    params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, features)))
    args = (params, jax.eval_shape(opt.init, params), jax.ShapeDtypeStruct((batch, features), jnp.float32),
            jax.ShapeDtypeStruct((batch,), jnp.int32))

    def step(params, opt_state, x, y):
        def loss(p):
            logits = model.apply(p, gs.shard(x, ("data", None)))
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step, args


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name, axis_index_groups=None):
    """jax.lax.ragged_all_to_all's documented semantics from all_gather (XLA:CPU cannot compile the real op):
    with k = len(send_sizes) / peers updates per peer, peer i sends operand[input_offsets[u]:][:send_sizes[u]]
    to peer u // k, which writes it at output_offsets[u] (k > 1 where a vmap batches the exchange)."""
    assert axis_index_groups is None
    me = jax.lax.axis_index(axis_name)
    ops = jax.lax.all_gather(operand, axis_name)  # [P, R, ...]
    peers = ops.shape[0]
    k = input_offsets.shape[0] // peers
    mine = me * k + jnp.arange(k)  # the updates each source sends me
    starts = jax.lax.all_gather(input_offsets, axis_name)[:, mine]  # [P, k]: where each source's rows begin
    sizes = jax.lax.all_gather(send_sizes, axis_name)[:, mine]
    dests = jax.lax.all_gather(output_offsets, axis_name)[:, mine]
    rows = jnp.arange(output.shape[0])
    for i in range(peers):
        for j in range(k):
            inside = (rows >= dests[i, j]) & (rows < dests[i, j] + sizes[i, j])
            src = jnp.clip(starts[i, j] + rows - dests[i, j], 0, operand.shape[0] - 1)
            mask = inside.reshape((-1,) + (1,) * (output.ndim - 1))
            output = jnp.where(mask, jnp.take(ops[i], src, axis=0), output)
    del recv_sizes  # the receiver's view of sizes; the sender's send_sizes decide what lands
    return output


@contextlib.contextmanager
def ragged_all_to_all_emulated_on_cpu():
    """The real jax.lax.ragged_all_to_all primitive (traced, batched, differentiated and partitioned as on a
    GPU) lowered on XLA:CPU by `emulated_ragged_all_to_all`; JAX's own lowering is back afterwards."""
    prim = _primitives.ragged_all_to_all_p
    table = mlir._platform_specific_lowerings["cpu"]
    before = table.get(prim)
    mlir.register_lowering(prim, mlir.lower_fun(emulated_ragged_all_to_all, multiple_results=False),
                           platform="cpu")
    try:
        yield
    finally:
        if before is None:
            table.pop(prim, None)
        else:
            table[prim] = before
