"""The registry's claim: propagation, lowering and the program rewrites ask an op's entry, never its name; and
the rules built by rules.pieces_rule (concatenate, split, stack, unstack)."""
import os
import re

import jax
import jax.numpy as jnp

import gshard_jax as gs  # noqa: F401  (registers our annotation primitive)
from gshard_jax.partitioner.representation.program import from_jaxpr
from gshard_jax.partitioner.strategies import control_flow as CF, registry as REG

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
READERS = ["propagation/propagate.py", "lowering/lower.py", "lowering/local_shards.py", "lowering/lower_regions.py",
           "lowering/lower_rows.py", "propagation/fold.py"]


def test_the_passes_never_test_an_op_name():
    """No comparison of a name with a literal (`e.name == "scan"`, `name in ("pad", "slice")`) in the modules
    the registry's docstring says read only the registry."""
    found = []
    for f in READERS:
        with open(os.path.join(ROOT, "partitioner", f)) as src:
            for n, line in enumerate(src, 1):
                code = line.split("#")[0]
                literal = re.search(r"\bname\s*(==|!=|\bin\b|\bnot in\b)\s*[\"'(\[{]", code)
                if literal or re.search(r"FORMS\s*(\[|\.get)", code):
                    found.append(f"{f}:{n}: {line.strip()}")
    assert not found, "\n".join(found)


def test_every_control_flow_form_has_an_entry_pointing_to_it():
    for name, form in CF.FORMS.items():
        assert REG.op_for(name).form is form
        assert REG.op_for(name).rule(None) is None


def test_roles():
    assert REG.op_for("sharding_annotation").annotation
    assert REG.op_for("remat2").checkpoint
    assert REG.op_for("shard_map").manual
    assert REG.op_for("pad").fold.pad and REG.op_for("slice").fold.cut
    assert REG.op_for("copy").fold.identity and REG.op_for("convert_element_type").fold.convert
    assert REG.op_for("sin").fold.keeps_constant and not REG.op_for("device_put").fold.keeps_constant
    assert REG.op_for("reduce_prod").fold.reduce is None and REG.op_for("reduce_sum").fold.reduce(2.0, 3) == 6.0
    assert not REG.mergeable("io_callback") and REG.mergeable("add")


def _rule(fn, *shapes):
    program = from_jaxpr(jax.make_jaxpr(fn)(*[jnp.zeros(s) for s in shapes]))
    return [str(REG.rule_for(e)) for e in program.eqns]


def test_pieces_rules():
    assert _rule(lambda x: jnp.stack([x, x, x], axis=1), (4, 8)) == [
        "([a, c], [a, c], [a, c])->([a, b, c]) {a=4, b=3, c=8} need_replication={b}"]
    assert _rule(lambda x: list(jnp.unstack(x, axis=0)), (2, 8)) == [
        "([a, b])->([b], [b]) {a=2, b=8} need_replication={a}"]
    assert _rule(lambda x, y: jnp.concatenate([x, y], axis=0), (4, 8), (2, 8)) == [
        "([c, b], [d, b])->([a, b]) {a=6, b=8, c=4, d=2} ties={c~a, d~a} (not propagated)"]
    assert _rule(lambda x: jnp.split(x, [2, 5], axis=1), (4, 8)) == [
        "([a, b])->([a, c], [a, d], [a, e]) {a=4, b=8, c=2, d=3, e=3} ties={c~b, d~b, e~b}"]
