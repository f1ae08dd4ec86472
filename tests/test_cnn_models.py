"""The convolutional models (models/cnn.py): one train step, data-parallel and spatially split, partitioned."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gshard_jax as gs
from gshard_jax.models import cnn
from helpers import assert_report_matches_hlo, get_mesh, hlo_stats, load_script

CASES = {"resnet": (cnn.ResNet, (8, 32, 32, 3), False), "unet3d": (cnn.UNet3D, (8, 16, 16, 16, 1), True)}


def setup(name: str, rules):
    model_cls, shape, per_voxel = CASES[name]
    cfg = cnn.CNNConfig()
    model = model_cls(cfg, rules)
    images, labels = cnn.example_batch(jax.random.key(0), shape, cfg.classes, per_voxel)
    params = model.init(jax.random.key(1), images)
    step = functools.partial(cnn.train_step, model=model, cfg=cfg)
    return step, (params, cnn.optimizer(cfg).init(params), images, labels)


@pytest.mark.parametrize("rules", ["data", "spatial"])
@pytest.mark.parametrize("name", list(CASES))
def test_cnn_train_step(name, rules):
    mesh = get_mesh("2x4")
    step, args = setup(name, cnn.DATA_PARALLEL if rules == "data" else cnn.SPATIAL)
    report = gs.explain(step, mesh, *args)
    assert not report.fallbacks, [(r.primitive, r.source) for r in report.fallbacks]
    ours_fn = gs.partition(step, mesh)
    got, want = ours_fn(*args), jax.jit(step)(*args)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * max(1.0, float(jnp.max(jnp.abs(w)))))
    stats = hlo_stats(ours_fn, *args)
    assert_report_matches_hlo(report, stats)
    convs = [r for r in report.rows if r.primitive in ("conv_general_dilated", "reduce_window_max",
                                                         "select_and_scatter_add")]
    assert convs
    if rules == "spatial":  # every window reads its neighbours' rows; no conv or pooling gathers its input
        assert stats["collective-permute"]["count"] > 0
        assert not [c for r in convs for c in r.collectives if c.kind == "all-gather"]
    else:  # data-parallel: convolutions exchange nothing (kernel gradients are summed), no more bytes than XLA
        assert not [c for r in convs for c in r.collectives if c.kind not in ("all-reduce", "reduce-scatter")]
        xla = hlo_stats(gs.partition(step, mesh, backend="xla"), *args)
        moved = lambda s: sum(v["moved_bytes"] for v in s.values())
        assert moved(stats) <= moved(xla) + 8, (moved(stats), moved(xla))


def test_spatial_example_runs(capsys):
    """examples/spatial_cnn.py: one spatially split U-Net step equal to the unpartitioned one, and its report."""
    load_script("examples", "spatial_cnn.py").main(["--depth", "16"])
    out = capsys.readouterr().out
    diff = float(out.split("max |params - unpartitioned| = ")[1].split()[0])
    assert diff < 1e-5 and "collective-permute" in out and "fallbacks: 0" in out, out
