"""The op registry: one entry per primitive, grouped as Shardy groups them, and each rule printed as a
signature (as Shardy's op_sharding_rule_registry.mlir tests print theirs)."""
import importlib
import pkgutil

import jax
import jax.numpy as jnp
import pytest
from jax._src import core

import gshard_jax as gs  # noqa: F401  (registers our annotation primitive)
from gshard_jax import annotations
from gshard_jax.partitioner.propagation import constraints
from gshard_jax.partitioner.representation.jax_compat import NOT_IN_EVERY_RELEASE
from gshard_jax.partitioner.representation.program import from_jaxpr
from gshard_jax.partitioner.strategies import registry as REG

pytestmark = pytest.mark.newest_jax  # .ci/run runs this file on the newest supported JAX too


def _installed_primitives() -> set[str]:
    """Every primitive name the installed JAX (and our annotations) define."""
    import jax._src as src
    names = set()
    for info in pkgutil.walk_packages(src.__path__, "jax._src."):
        try:
            module = importlib.import_module(info.name)
        except Exception:  # modules for other platforms fail to import here
            continue
        names |= {v.name for v in vars(module).values() if isinstance(v, core.Primitive)}
    names |= {v.name for v in vars(annotations).values() if isinstance(v, core.Primitive)}
    return names


def test_every_entry_names_a_primitive_of_the_installed_jax():
    """Or of another supported release, as jax_compat.NOT_IN_EVERY_RELEASE says (and only those)."""
    names = _installed_primitives()
    entries = set(REG.OPS) | REG.POINTWISE
    assert not entries - names - set(NOT_IN_EVERY_RELEASE)
    assert set(NOT_IN_EVERY_RELEASE) <= entries


def test_pointwise_ops_are_one_case_and_the_rest_alphabetical():
    assert not REG.POINTWISE & set(REG.OPS)
    assert list(REG.OPS) == sorted(REG.OPS)
    assert REG.op_for("mul") is REG.op_for("sin")
    assert REG.op_for("no_such_primitive") is None


CASES = {
  "add": (lambda x, y: x + y, [(4, 8), (4, 8)]),
  "dot_general": (lambda x, y: x @ y, [(2, 3), (3, 5)]),
  "reduce_sum": (lambda x: x.sum(1), [(4, 8)]),
  "reduce_max": (lambda x: x.max(0), [(4, 8)]),
  "transpose": (lambda x: x.T, [(4, 8)]),
  "reshape": (lambda x: x.reshape(24), [(6, 4)]),
  "broadcast_in_dim": (lambda x: jnp.broadcast_to(x, (3, 4, 8)), [(4, 8)]),
  "sort": (lambda x: jnp.sort(x, axis=1), [(4, 8)]),
  "cumsum": (lambda x: jnp.cumsum(x, axis=1), [(4, 8)]),
  "conv_general_dilated": (lambda x, w: jax.lax.conv_general_dilated(x, w, (1,), "SAME",
                                                                      dimension_numbers=("NWC", "WIO", "NWC")),
                           [(2, 16, 3), (3, 3, 4)]),
  "split": (lambda x: jnp.split(x, [2, 5], axis=1), [(4, 8)]),
  "concatenate": (lambda x, y: jnp.concatenate([x, y], axis=0), [(4, 8), (2, 8)]),
  "slice": (lambda x: x[:, 1:7:2], [(4, 8)]),
}

SIGNATURES = {
    "add": "([a, b], [a, b])->([a, b]) {a=4, b=8} pointwise",
    "dot_general": "([a, b], [b, c])->([a, c]) {a=2, b=3, c=5} reduction={b} rings",
    "reduce_sum": "([a, b])->([a]) {a=4, b=8} reduction={b}",
    "reduce_max": "([a, b])->([b]) {a=4, b=8} reduction={a:max}",
    "transpose": "([a, b])->([b, a]) {a=4, b=8}",
    "reshape": "([a, b])->([ab]) {a=6, b=4}",
    "broadcast_in_dim": "([b, c])->([a, b, c]) {a=3, b=4, c=8} late_backward",
    "sort": "([a, b])->([a, b]) {a=4, b=8} need_replication={b}",
    "cumsum": "([a, b])->([a, b]) {a=4, b=8}",
    "conv_general_dilated": "([b, d, a], [e, a, c])->([b, f, c]) {a=3, b=2, c=4, d=16, e=3, f=16} reduction={a} "
                            "need_replication={e} ties={f~d}",
    "split": "([a, b])->([a, c], [a, d], [a, e]) {a=4, b=8, c=2, d=3, e=3} ties={c~b, d~b, e~b}",
    "concatenate": "([c, b], [d, b])->([a, b]) {a=6, b=8, c=4, d=2} ties={c~a, d~a} (not propagated)",
    "slice": "([a, b])->([a, c]) {a=4, b=8, c=3} ties={c~b}",
}


@pytest.mark.parametrize("prim", list(CASES))
def test_rule_signature(prim):
    fn, shapes = CASES[prim]
    program = from_jaxpr(jax.make_jaxpr(fn)(*[jnp.zeros(s) for s in shapes]))
    eqn = next(e for e in program.eqns if e.name == prim)
    assert str(REG.rule_for(eqn)) == SIGNATURES[prim]


def test_control_flow_links_are_marked_as_links():
    def f(x):
        return jax.lax.scan(lambda c, y: (c + y, c), x[0], x)[0]
    program = from_jaxpr(jax.make_jaxpr(f)(jnp.zeros((4, 8))))
    (scan,) = [e for e in program.eqns if e.name == "scan"]
    into, out = constraints.control_flow_links(scan)
    assert into and out and all(c.rule.link for c in into + out)
    assert all(str(c.rule).endswith(" link") for c in into + out)
