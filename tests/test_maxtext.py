"""MaxText's own MoE decoders, partitioned: Mixtral-style and DeepSeek-style, as MaxText builds and trains them.

Each model is MaxText's NNX Transformer built by its own `pyconfig` (base.yml with a model_name and
argv-style overrides for small widths, as its users set them), on the mesh MaxText makes from that config
(`maxtext_utils.get_mesh_from_config`: fsdp over all 8 devices) with its params and batch placed by its
logical-axis rules, layers scanned and rematerialised (`scan_layers`, `remat_policy=full`, as shipped),
and its MoE blocks as shipped (`sparse_matmul` with the megablox kernel, inside MaxText's own shard_map).
The step is MaxText's `train.loss_fn` under `jax.value_and_grad`, as its `train_step` differentiates it.

gs.partition of that step must equal jax.jit's (loss and every gradient), explain() must show no
fallback row, and the bytes moved per device per step (loop bodies times their trips) must be at most
XLA's partitioner's on the same step.

Needs MaxText (Python 3.12, JAX 0.11+): README's "Run the tests" has the install; skipped without it.
Run it with `python -m pytest -m maxtext tests/test_maxtext.py`.
"""
import os

import jax
import numpy as np
import pytest

pytest.importorskip("maxtext")

from flax import nnx  # noqa: E402
from flax.core.spmd import logical_axis_rules  # noqa: E402
from maxtext.configs import pyconfig  # noqa: E402
from maxtext.trainers.pre_train import train  # noqa: E402
from maxtext.utils import maxtext_utils, model_creation_utils, sharding as mt_sharding  # noqa: E402

import gshard_jax as gs  # noqa: E402
from helpers import assert_close  # noqa: E402

pytestmark = pytest.mark.maxtext

BASE_YML = os.path.join(os.path.dirname(pyconfig.__file__), "base.yml")

# Small widths over MaxText's own model configs; everything else is base.yml's and the model file's.
SMALL = ["override_model_config=true", "base_emb_dim=64", "base_num_query_heads=4", "base_num_kv_heads=4",
         "base_mlp_dim=64", "base_moe_mlp_dim=64", "head_dim=16", "vocab_size=256", "dtype=float32",
         "per_device_batch_size=1", "max_target_length=32", "attention=dot_product", "hardware=cpu",
         "enable_checkpointing=false", "skip_jax_distributed_system=true", "log_config=false",
         "enable_dropout=false", "run_name=gshard_jax_test"]
MODELS = {
    # 2 MoE layers of 8 experts, top-2 (configs/models/mixtral-8x7b.yml)
    "mixtral": ["model_name=mixtral-8x7b", "base_num_decoder_layers=2"],
    # 1 dense + 2 MoE layers, MLA attention, a shared expert, sigmoid routing with a routed bias
    # (configs/models/deepseek3-tiny.yml), 8 experts top-2
    "deepseek": ["model_name=deepseek3-tiny", "base_num_decoder_layers=3", "first_num_dense_layers=1",
                 "num_experts=8", "num_experts_per_tok=2", "qk_nope_head_dim=16", "qk_rope_head_dim=8",
                 "v_head_dim=16", "max_position_embeddings=1024", "original_max_position_embeddings=64",
                 "rope_factor=4"],
}


def maxtext_step(name):
    """MaxText's config, mesh, loss/grad step and its arguments placed by MaxText's rules."""
    config = pyconfig.initialize(["", BASE_YML] + SMALL + MODELS[name])
    assert config.scan_layers and config.remat_policy == "full" and config.sparse_matmul and config.megablox
    mesh = maxtext_utils.get_mesh_from_config(config)
    create, abstract = model_creation_utils.create_nnx_abstract_model(config, mesh)
    with jax.set_mesh(mesh), logical_axis_rules(config.logical_axis_rules):
        model = create()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    _, abstract_params, abstract_rest = nnx.split(abstract, nnx.Param, ...)
    params = jax.device_put(params, jax.tree.map(lambda a: a.sharding, abstract_params))
    rest = jax.device_put(rest, jax.tree.map(lambda a: a.sharding, abstract_rest))

    B, L = config.global_batch_size_to_train_on, config.max_target_length
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (B, L + 1)).astype(np.int32)
    positions = np.tile(np.arange(L, dtype=np.int32), (B, 1))
    data = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "inputs_position": positions,
            "targets_position": positions, "inputs_segmentation": np.ones((B, L), np.int32),
            "targets_segmentation": np.ones((B, L), np.int32)}
    data = jax.device_put(data, mt_sharding.get_input_data_sharding(config, mesh))

    def step(params, rest, data):
        def loss(params):
            local = nnx.merge(graphdef, params, rest, copy=True)
            return train.loss_fn(local, config, dict(data), None, None, is_train=True)[0]
        return jax.value_and_grad(loss)(params)

    return config, mesh, step, (params, rest, data)


def moved_per_step(compiled):
    return sum(v["moved_bytes"] for v in gs.collective_stats(compiled, per_step=True).values())


@pytest.mark.parametrize("name", list(MODELS))
def test_maxtext_moe_decoder_train_step(name):
    config, mesh, step, args = maxtext_step(name)
    with jax.set_mesh(mesh), logical_axis_rules(config.logical_axis_rules):
        want = jax.jit(step)(*args)
        report = gs.explain(step, mesh, *args)
        ours = gs.partition(step, mesh).lower(*args).compile()
        got = ours(*args)
        xla = gs.partition(step, mesh, backend="xla").lower(*args).compile()
    assert report.rows
    assert not report.fallbacks, [(r.primitive, r.source) for r in report.fallbacks]
    assert_close(got, want)
    ours_bytes, xla_bytes = moved_per_step(ours), moved_per_step(xla)
    print(f"{name}: moved bytes per device per step {ours_bytes:,.0f}, XLA's {xla_bytes:,.0f}, "
          f"ratio {ours_bytes / xla_bytes:.2f}")
    assert 0 < ours_bytes <= xla_bytes, (ours_bytes, xla_bytes)
