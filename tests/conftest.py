"""Eight simulated CPU devices for every test (set before jax initialises). JAX_PLATFORMS=cpu (inherited by the
tests' subprocesses): where libtpu or JAX's CUDA plugin is installed to compile for TPU and GPU targets
(gshard_jax/targets), it starts no backend of its own; those targets compile beside the CPU devices."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import gshard_jax as gs  # noqa: E402

MESHES = {"8": {"x": 8}, "2x4": {"data": 2, "model": 4}, "2x2x2": {"a": 2, "b": 2, "c": 2}}


SLOW_CASES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "slow_cases.txt")


def slow_cases() -> set[str]:
    """The node ids tests/slow_cases.txt lists (the default suite's heaviest cases)."""
    with open(SLOW_CASES) as f:
        return {line.strip() for line in f if line.strip() and not line.startswith("#")}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    slow = slow_cases()
    for item in items:
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)
    if len(jax.devices()) < 8:
        skip = pytest.mark.skip(reason="needs 8 (simulated) devices")
        for item in items:
            if "mesh" in item.fixturenames or "multidevice" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(params=list(MESHES), ids=list(MESHES))
def mesh(request):
    return gs.make_mesh(MESHES[request.param])


@pytest.fixture
def rng():
    return np.random.default_rng(0)
