"""Convolutions and pooling on split dims: halo exchange, never a gather of the split dim (issue: halo exchange).

Every case runs forward and under jax.grad, partitioned and unpartitioned, and
compares the collectives of the compiled program with explain().
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gshard_jax as gs
from helpers import assert_report_matches_hlo, get_mesh, hlo_stats


def ints(rng, *shape):
    """Small integers stored as float32: every sum below is exact, so results must be equal, not close,
    whatever order the partitioned program adds in."""
    return rng.integers(-2, 3, shape).astype(np.float32)


def close(out, ref):
    for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def run(f, mesh, *args):
    """Partitioned == unpartitioned, no fallback row, report == HLO; the compiled collectives by kind."""
    out = gs.partition(f, mesh)(*args)
    close(out, f(*args))
    report = gs.explain(f, mesh, *args)
    assert not report.fallbacks, report.table()
    stats = hlo_stats(gs.partition(f, mesh), *args)
    assert_report_matches_hlo(report, stats)
    return {k: v["count"] for k, v in stats.items()}


def grads(f):
    """d/d(every arg) of a projection of f's output (an integer cotangent that is not all ones)."""
    def loss(*args):
        y = f(*args)
        return jnp.sum(y * (jnp.arange(y.size).reshape(y.shape) % 5 - 2).astype(y.dtype))
    return jax.grad(loss, argnums=tuple(range(f.__code__.co_argcount)))


def conv2d(spec, stride=1, padding="SAME", rhs_dilation=1, lhs_dilation=1, groups=1):
    def f(x, w):
        return jax.lax.conv_general_dilated(gs.shard(x, spec), w, (stride, stride), padding,
                                            lhs_dilation=(lhs_dilation,) * 2, rhs_dilation=(rhs_dilation,) * 2,
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                            feature_group_count=groups)
    return f


H_SPLIT = {"8": (None, "x", None, None), "2x4": (None, "data", "model", None)}  # H on 8, or H and W on 2 axes


CASES = [(case, m) for case in ("3x3 same", "7x7 stride 2 pad 3", "dilated", "wider than a shard",
                                 "uneven 30 rows", "valid", "transposed") for m in ("8", "2x4")
         if (case, m) not in (("wider than a shard", "2x4"), ("uneven 30 rows", "2x4"))]
# On {2,4} with H split over both axes (data major): small activations, 8 shards, halos always cheaper.
CASES += [("wider than a shard", "2x4 one dim"), ("uneven 30 rows", "2x4 one dim")]
H_SPLIT["2x4 one dim"] = (None, ("data", "model"), None, None)


@pytest.mark.parametrize("case,mesh_name", CASES)
def test_spatially_split_conv(case, mesh_name, rng):
    mesh, spec = get_mesh(mesh_name.split()[0]), H_SPLIT[mesh_name]
    # A few KB per device: the split dims stay split (memory in the strategy choice), where two exchanges cost more
    # time than one all-gather.
    b, c = (4, 16) if mesh_name != "2x4" else (2, 4)
    hw = {"uneven 30 rows": (30, 16), "wider than a shard": (64, 64)}.get(
        case, (64, 16) if mesh_name != "2x4" else (32, 32))
    x = ints(rng, b, *hw, c)
    kernel = {"7x7 stride 2 pad 3": (7, 7), "wider than a shard": (25, 1)}.get(case, (3, 3))
    cout = 16 if (mesh_name, case) in (("2x4", "7x7 stride 2 pad 3"), ("8", "wider than a shard"),
                                       ("2x4 one dim", "wider than a shard")) else 4  # output (the input
    w = ints(rng, *kernel, c, cout)  # gradient's input) as large as x
    f = {"3x3 same": conv2d(spec), "7x7 stride 2 pad 3": conv2d(spec, 2, ((3, 3), (3, 3))),
         "dilated": conv2d(spec, rhs_dilation=2), "wider than a shard": conv2d(spec),
         "uneven 30 rows": conv2d(spec), "valid": conv2d(spec, padding="VALID"),
         "transposed": conv2d(spec, padding=((2, 1), (2, 1)), lhs_dilation=2)}[case]
    fwd = run(f, mesh, x, w)
    back = run(grads(f), mesh, x, w)
    if case not in ("uneven 30 rows", "valid"):  # even outputs: nothing gathered, not even on exit
        assert fwd["all-gather"] == 0 and back["all-gather"] == 0, (fwd, back)
    assert back["all-reduce"] + back["reduce-scatter"] >= 1  # the kernel gradient is a partial sum
    if case == "3x3 same" and mesh_name == "8":
        assert fwd == {**fwd, "collective-permute": 2, "all-gather": 0, "all-reduce": 0, "all-to-all": 0}
    if case == "wider than a shard" and mesh_name != "2x4":
        assert fwd["collective-permute"] == 4


def test_causal_conv1d_has_a_left_halo_only(rng):
    mesh = get_mesh("8")
    x, w = ints(rng, 2, 64, 4), ints(rng, 5, 4, 6)

    def f(x, w):
        return jax.lax.conv_general_dilated(gs.shard(x, (None, "x", None)), w, (1,), ((4, 0),),
                                            dimension_numbers=("NWC", "WIO", "NWC"))
    assert run(f, mesh, x, w)["collective-permute"] == 1
    run(grads(f), mesh, x, w)


def test_base_dilation_out_of_phase_gathers(rng):
    """A transposed conv whose shards would start at different dilation phases (3 output rows per shard,
    dilation 2) gathers that dim, as XLA's partitioner does; its kernel gradient too."""
    mesh = get_mesh("8")
    x, w = ints(rng, 2, 12, 3), ints(rng, 3, 3, 2)

    def f(x, w):
        return jax.lax.conv_general_dilated(gs.shard(x, (None, "x", None)), w, (1,), ((2, 1),), lhs_dilation=(2,),
                                            dimension_numbers=("NWC", "WIO", "NWC"))
    run(f, mesh, x, w)
    run(grads(f), mesh, x, w)


@pytest.mark.parametrize("mesh_name", ["8", "2x4"])
def test_3d_conv_split_on_depth(mesh_name, rng):
    mesh = get_mesh(mesh_name)
    if mesh_name == "8":  # depth on 8 devices
        x, w, spec = ints(rng, 2, 32, 8, 8, 2), ints(rng, 3, 3, 3, 2, 2), (None, "x", None, None, None)
    else:  # batch on data, depth on model
        x, w, spec = ints(rng, 2, 16, 16, 8, 2), ints(rng, 3, 3, 3, 2, 2), ("data", "model", None, None, None)

    def f(x, w):
        return jax.lax.conv_general_dilated(gs.shard(x, spec), w, (1, 1, 1),
                                            "SAME", dimension_numbers=("NDHWC", "DHWIO", "NDHWC"))
    counts = run(f, mesh, x, w)
    assert counts["collective-permute"] == 2 and counts["all-gather"] == 0
    run(grads(f), mesh, x, w)


@pytest.mark.parametrize("mesh_name", ["8", "2x4"])
@pytest.mark.parametrize("split", ["batch", "out features", "in features", "groups", "depthwise"])
def test_feature_and_group_splits(split, mesh_name, rng):
    mesh = get_mesh(mesh_name)
    one, two = ("x", "x") if mesh_name == "8" else ("data", "model")  # the axis of the split (2 or 4; 8)
    c = 16 if mesh_name == "8" else 8
    groups = {"groups": 8 if mesh_name == "8" else 2, "depthwise": c}.get(split, 1)
    x, w = ints(rng, 8, 8, 8, c), ints(rng, 3, 3, c // groups, 16)
    xs = {"batch": (one, None, None, None), "in features": (None, None, None, two),
          "groups": (None, None, None, one), "depthwise": (None, None, None, two)}.get(split)
    ws = {"out features": (None, None, None, two), "in features": (None, None, two, None),
          "groups": (None, None, None, one), "depthwise": (None, None, None, two)}.get(split)

    def f(x, w):
        x = gs.shard(x, xs) if xs else x
        w = gs.shard(w, ws) if ws else w
        return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                            feature_group_count=groups)
    fwd = run(f, mesh, x, w)
    back = run(grads(f), mesh, x, w)
    assert fwd["all-gather"] == 0, fwd
    if split == "in features":
        assert fwd["all-reduce"] + fwd["reduce-scatter"] == 1  # a contraction: one partial sum
    if split in ("groups", "depthwise", "out features", "batch"):
        assert fwd["all-reduce"] == 0 and fwd["collective-permute"] == 0
    if split == "batch":
        assert back["all-reduce"] + back["reduce-scatter"] >= 1  # the kernel gradient sums over the batch


@pytest.mark.parametrize("mesh_name", ["8", "2x4"])
@pytest.mark.parametrize("kind", ["max", "min", "avg"])
@pytest.mark.parametrize("window", ["3x3 stride 1 same", "2x2 stride 2", "3x3 stride 2 same"])
def test_pooling_on_a_split_dim(kind, window, mesh_name, rng):
    mesh = get_mesh(mesh_name)
    rows = (None, "x", None, None) if mesh_name == "8" else (None, ("data", "model"), None, None)
    x = ints(rng, 2, 32, 8, 3)
    dims, strides, pad = {"3x3 stride 1 same": ((1, 3, 3, 1), (1, 1, 1, 1), "SAME"),
                          "2x2 stride 2": ((1, 2, 2, 1), (1, 2, 2, 1), "VALID"),
                          "3x3 stride 2 same": ((1, 3, 3, 1), (1, 2, 2, 1), "SAME")}[window]

    def f(x):
        x = gs.shard(x, rows)
        if kind == "max":
            return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, dims, strides, pad)
        if kind == "min":
            return jax.lax.reduce_window(x, jnp.inf, jax.lax.min, dims, strides, pad)
        return jax.lax.reduce_window(x, 0.0, jax.lax.add, dims, strides, pad) / 9.0
    counts = run(f, mesh, x)
    assert counts["all-gather"] == 0, counts
    halos = {"3x3 stride 1 same": 2, "2x2 stride 2": 0, "3x3 stride 2 same": 1}[window]
    assert counts["collective-permute"] == halos
    back = run(grads(f), mesh, x)  # max/min: select_and_scatter_add, the halo exchanged there and back
    assert back["all-gather"] == 0 and back["collective-permute"] == halos * (1 if kind == "avg" else 2), back


SHIFTS = {  # (function of a [B, L, D] array split on L, halo exchanges expected)
    "shift right": (lambda x: jnp.pad(x, ((0, 0), (1, 0), (0, 0)))[:, :-1], 1),
    "shift left": (lambda x: jnp.pad(x[:, 1:], ((0, 0), (0, 1), (0, 0))), 1),
    "pad both sides, sliced back": (lambda x: jnp.pad(x, ((0, 0), (2, 3), (0, 0)))[:, 1:-4], 1),  # = pad (1, -1)
    "strided slice": (lambda x: x[:, ::2], 0),
}


@pytest.mark.parametrize("name", list(SHIFTS))
def test_pad_and_slice_on_a_split_sequence_exchange_neighbours(name, rng):
    """With both sides split on the sequence, a shift moves one row per device by collective-permute: the pad
    folds into the slice (partitioner/propagation/fold.py) and nothing is gathered."""
    fn, permutes = SHIFTS[name]
    mesh = get_mesh("8")
    x = ints(rng, 4, 64, 8)

    def f(x):
        return gs.shard(fn(gs.shard(x, (None, "x", None))), (None, "x", None))
    counts = run(f, mesh, x)
    assert counts["all-gather"] == 0 and counts["collective-permute"] == permutes, counts
    back = run(grads(f), mesh, x)
    assert back["all-gather"] == 0 and back["collective-permute"] == permutes, back


REORDERS = {  # (function of a [B, L, D] array, its mesh, halo exchanges expected or None: the cost model decides)
    "rev": (lambda x: x[:, ::-1], "8", 1),  # local reverse, then block i <-> block k-1-i
    "rev on two axes": (lambda x: x[:, ::-1], "2x4", 1),
    "rev uneven": (lambda x: x[:, 2:][:, ::-1], "8", None),
    "concatenate": (lambda x: jnp.concatenate([x, 2 * x], axis=1), "8", None),
    "roll": (lambda x: jnp.roll(x, 3, axis=1), "8", None),
}


@pytest.mark.parametrize("name", list(REORDERS))
def test_reversal_concatenation_and_roll_of_a_split_sequence(name, rng):
    fn, mesh_name, permutes = REORDERS[name]
    mesh = get_mesh(mesh_name)
    seq = (None, "x", None) if mesh_name == "8" else (None, ("b", "a"), None)
    if mesh_name == "2x4":
        mesh = gs.make_mesh({"a": 2, "b": 4})  # axes listed out of mesh order on the split dim
    x = ints(rng, 4, 64, 8)

    def f(x):
        return gs.shard(fn(gs.shard(x, seq)), seq)
    counts = run(f, mesh, x)
    run(grads(f), mesh, x)
    if permutes is not None:
        assert counts["all-gather"] == 0 and counts["collective-permute"] == permutes, counts


@pytest.mark.parametrize("window", ["3x3 stride 1 same", "3x3 stride 2 same"])
def test_max_pooling_jvp_exchanges_tangent_halos(window, rng):
    """Forward-mode max pooling (select_and_gather_add): the tangent gets the same halo rows as the operand,
    whose exchange is shared with the pooling itself."""
    mesh = get_mesh("8")
    x, t = ints(rng, 2, 32, 8, 3), ints(rng, 2, 32, 8, 3)
    strides = (1, 1, 1, 1) if "stride 1" in window else (1, 2, 2, 1)

    def f(x):
        return jax.lax.reduce_window(gs.shard(x, (None, "x", None, None)), -jnp.inf, jax.lax.max, (1, 3, 3, 1),
                                     strides, "SAME")
    counts = run(lambda x, t: jax.jvp(f, (x,), (t,)), mesh, x, t)
    halos = 2 if "stride 1" in window else 1
    assert counts["all-gather"] == 0 and counts["collective-permute"] == 2 * halos, counts


def test_dynamic_slice_with_constant_starts_is_a_slice(rng):
    """dynamic_slice at constant offsets (clamped as dynamic_slice clamps) takes the slice's halo path."""
    mesh = get_mesh("8")
    x = ints(rng, 4, 64, 8)
    seq = (None, "x", None)

    def f(x):
        a = jax.lax.dynamic_slice_in_dim(gs.shard(x, seq), 3, 56, axis=1)
        b = jax.lax.dynamic_slice_in_dim(gs.shard(x, seq), 60, 56, axis=1)  # clamped to start 8
        return gs.shard(a, seq), gs.shard(b, seq)
    counts = run(f, mesh, x)  # 7-row result blocks from 8-row shards: a needs 1 hop each way, b one to the right
    assert counts["all-gather"] == 0 and counts["collective-permute"] == 3, counts
    run(grads(lambda x: f(x)[0] + f(x)[1]), mesh, x)


@pytest.mark.parametrize("strides", [(1, 1, 1), (1, 2, 1)])
def test_generic_reduce_window_pads_halos_with_its_init_value(strides, rng):
    """lax.reduce_window with its own computation (a product): halo rows outside the input are the init value."""
    mesh = get_mesh("8")
    x = rng.integers(1, 3, (2, 32, 8)).astype(np.float32)
    seq = (None, "x", None)

    def f(x):
        y = jax.lax.reduce_window(gs.shard(x, seq), 1.0, lambda a, b: a * b, (1, 3, 1), strides, "SAME")
        return gs.shard(y, seq)
    counts = run(f, mesh, x)
    assert counts["all-gather"] == 0 and counts["collective-permute"] == (2 if strides[1] == 1 else 1), counts


def test_causal_conv1d_on_two_axes(rng):
    mesh = get_mesh("2x4")
    x, w = ints(rng, 2, 64, 4), ints(rng, 5, 4, 6)

    def f(x, w):
        return jax.lax.conv_general_dilated(gs.shard(x, (None, ("data", "model"), None)), w, (1,), ((4, 0),),
                                            dimension_numbers=("NWC", "WIO", "NWC"))
    counts = run(f, mesh, x, w)
    assert counts["collective-permute"] == 1 and counts["all-gather"] == 0, counts
    run(grads(f), mesh, x, w)


@pytest.mark.parametrize("kind", ["max", "avg"])
def test_pooling_with_height_and_width_split(kind, rng):
    """{2,4}: H on data, W on model, a few KB per device: two exchanges per dim, no gather."""
    mesh = get_mesh("2x4")
    x = ints(rng, 2, 32, 32, 4)

    def f(x):
        x = gs.shard(x, (None, "data", "model", None))
        if kind == "max":
            y = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 1, 1, 1), "SAME")
        else:
            y = jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 3, 3, 1), (1, 1, 1, 1), "SAME") / 9.0
        return gs.shard(y, (None, "data", "model", None))
    counts = run(f, mesh, x)
    assert counts["all-gather"] == 0 and counts["collective-permute"] == 4, counts
    back = run(grads(f), mesh, x)
    assert back["all-gather"] == 0, back


@pytest.mark.parametrize("mesh_name", ["8", "2x4"])
def test_dynamic_update_slice_at_constant_offsets_on_a_split_dim(mesh_name, rng):
    """Each device writes the update rows that land in its block: nothing moves when the update is whole."""
    mesh = get_mesh("8") if mesh_name == "8" else gs.make_mesh({"a": 2, "b": 4})
    seq = (None, "x", None) if mesh_name == "8" else (None, ("b", "a"), None)
    x, u = ints(rng, 4, 64, 8), ints(rng, 4, 20, 3)

    def f(x, u):
        a = jax.lax.dynamic_update_slice(gs.shard(x, seq), u, (0, 5, 2))
        return gs.shard(jax.lax.dynamic_update_slice(a, 2 * u, (0, 60, 7)), seq)  # clamped to (0, 44, 5)
    counts = run(f, mesh, x, u)
    assert sum(counts.values()) == 0, counts
    run(grads(f), mesh, x, u)
