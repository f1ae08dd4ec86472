"""Eight simulated CPU devices for every test (set before jax initialises)."""
import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import gshard_jax as gs  # noqa: E402

MESHES = {"8": {"x": 8}, "2x4": {"data": 2, "model": 4}, "2x2x2": {"a": 2, "b": 2, "c": 2}}


def pytest_collection_modifyitems(config, items):
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
