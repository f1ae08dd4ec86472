"""gshard_jax: GShard-style sharding annotations and an explainable SPMD partitioner for JAX."""
import importlib.util as _importlib_util
import os as _os

if _importlib_util.find_spec(__name__ + ".partitioner") is None:
    # partitioner/ and models/ sit beside gshard_jax/ in a checkout and join the package only when installed
    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    raise ImportError(
        f"gshard_jax was imported from {_os.path.dirname(_os.path.abspath(__file__))}, a checkout that is not "
        f"installed: its partitioner/ and models/ become gshard_jax.partitioner and gshard_jax.models only "
        f"through the install. Run `pip install -e {_root}` (the checkout is then what runs), or run from "
        f"outside {_root} so that an installed gshard_jax is imported instead of the checkout's.")

from jax.extend import source_info_util as _source_info_util

# Report source locations in the user's code, not in the annotation helpers or the libraries it calls.
_source_info_util.register_exclusion(_os.path.dirname(__file__) + _os.sep)
for _lib in ("flax", "optax", "orbax", "einops"):
    _spec = _importlib_util.find_spec(_lib)
    if _spec is not None and _spec.submodule_search_locations:
        for _path in _spec.submodule_search_locations:
            _source_info_util.register_exclusion(_path.rstrip(_os.sep) + _os.sep)
from .annotations import replicate, shard, split
from .api import chosen_shardings, explain, partition
from .manual import manual
from .mesh import make_mesh
from .partitioner.costs import hardware
from .partitioner.costs.hardware import Hardware
from .partitioner.lowering.fallback import NoRuleWarning
from .partitioner.reporting.hlo import collective_stats
from .partitioner.reporting.report import Report
from .partitioner.representation.sharding import Sharding
from .pipelines import pipeline, pipeline_value_and_grad

__all__ = ["make_mesh", "replicate", "split", "shard", "manual", "partition", "explain", "chosen_shardings", "Report",
           "Sharding", "Hardware", "hardware", "collective_stats", "pipeline", "pipeline_value_and_grad", "plan",
           "NoRuleWarning"]


def __getattr__(name: str):
    """gs.plan: the planner (gshard_jax.planner.plan), imported when first used."""
    if name == "plan":
        from .planner import plan
        return plan
    raise AttributeError(f"module 'gshard_jax' has no attribute {name!r}")
__version__ = "0.1.0"
