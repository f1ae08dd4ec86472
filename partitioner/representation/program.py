"""A flat, partitioner-owned view of a jaxpr.

Call-like primitives (pjit, closed_call, custom_jvp_call, custom_vjp_call)
are inlined, so propagation and lowering see one list of equations and every
decision is made with the whole program in view. Custom derivative rules are
not needed here: differentiation happens before partitioning
(``partition(jax.grad(f))``) or on the per-device program.

Bodies that must stay regions become sub-programs (Eqn.subs): the bodies of
the control-flow forms (`BODIES`: scan, while, cond), and checkpointed regions (``remat2``, from
jax.checkpoint /
nn.remat). A checkpointed region is *aliased*, not linked: its sub-program's
inputs are the caller's values and its results are the equation's results,
so propagation sees exactly the inlined program, while lowering re-emits the
body as a checkpoint (inlining would throw the rematerialisation away).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional, Sequence

from jax.extend import core, source_info_util

from .jax_compat import to_lojax

# Primitives whose body is inlined, and the param holding it.
CALL_PRIMITIVES = {
    "pjit": "jaxpr",
    "jit": "jaxpr",
    "closed_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "compute_on": "jaxpr",  # JAX 0.11+: ops computed elsewhere (the host); its ops keep the compute_type
}

# Control-flow primitives and the bodies each carries, by name (params -> {sub-program name: jaxpr}); how the
# passes treat each form is control_flow.FORMS, above this module.
BODIES = {
    "scan": lambda p: {"body": p["jaxpr"]},
    "while": lambda p: {"cond": p["cond_jaxpr"], "body": p["body_jaxpr"]},
    "cond": lambda p: {f"branch{i}": b for i, b in enumerate(p["branches"])},
}


@dataclasses.dataclass(eq=False)
class Value:
    """One array value of the program (identity-hashed)."""

    aval: Any
    name: str = ""

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.aval.shape)

    @property
    def dtype(self):
        return self.aval.dtype

    def __repr__(self) -> str:
        return self.name or f"v{id(self) % 10000}"


def shape_of(x) -> tuple[int, ...]:
    """The shape of an operand: a Value, a Const, or anything with an aval."""
    return tuple(x.aval.shape)


@dataclasses.dataclass(frozen=True, eq=False)
class Const:
    """A literal or closed-over constant operand."""

    val: Any
    aval: Any

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.aval.shape)


@dataclasses.dataclass(eq=False)
class Eqn:
    prim: Any
    invars: list  # Value | Const
    outvars: list  # Value
    params: dict
    where: Any  # (JAX source info, name-stack scope of the inlined call it sits in); see `source`
    index: int = -1
    subs: dict = dataclasses.field(default_factory=dict)  # control flow: name -> Program
    # Where the op computes when not on the device: "device_host" for an op traced under
    # jax.experimental.compute_on (an offloaded optimizer's update); its local op is bound there too.
    compute_type: Optional[str] = None
    # Which compute_on call the op came from (JAX 0.11+; -1: none): each call lowers as one region of its own,
    # so calls that need not wait for each other (an update in groups) stay apart.
    region: int = -1

    @property
    def source(self) -> str:
        """Where the user wrote the op, formatted on first use (most equations are never named)."""
        text = self.__dict__.get("_source")
        if text is None:
            text = self.__dict__["_source"] = _source(*self.where)
        return text

    @property
    def name(self) -> str:
        return self.prim.name


@dataclasses.dataclass
class Program:
    invars: list[Value]
    outvars: list  # Value | Const
    eqns: list[Eqn]
    consts: list[tuple[Value, Any]]  # closed-over arrays, passed to the per-device program as inputs

    def all_eqns(self):
        """Every equation, control-flow bodies included (depth first, in program order)."""
        for e in self.eqns:
            yield e
            for sub in e.subs.values():
                yield from sub.all_eqns()


def _source(source_info, scope: str = "") -> str:
    """Where the user wrote the op (file relative to the working directory) and its Flax module path.

    The module path is JAX's name stack (Flax pushes one entry per module);
    `scope` is the name stack of the inlined call the equation sits in.
    """
    try:
        loc = source_info_util.summarize(source_info)
    except Exception:  # pragma: no cover - source info is best effort
        loc = "?"
    cwd = os.getcwd() + os.sep
    if loc.startswith(cwd):
        loc = loc[len(cwd):]
    stack = _scope(source_info, scope)
    return f"{loc} [{stack}]" if stack else loc


def _scope(source_info, scope: str) -> str:
    """The name stack of an equation inside an inlined call with name stack `scope`."""
    return "/".join(p for p in (scope, str(source_info.name_stack)) if p)


def from_jaxpr(closed: core.ClosedJaxpr) -> Program:
    """Flatten a closed jaxpr into a Program, inlining call-like primitives.

    Bodies of scan, while and cond become sub-programs (Eqn.subs); their
    closed-over constants are hoisted into the top-level program's consts.
    """
    flat = _Flatten()
    top = flat.sub_program(to_lojax(closed))
    return Program(top.invars, top.outvars, top.eqns, flat.consts)


class _Flatten:
    """from_jaxpr's walk: values numbered as made, constants hoisted, compute_on calls counted."""

    def __init__(self):
        self.counter = 0
        self.regions = 0  # compute_on calls seen
        self.consts: list[tuple[Value, Any]] = []

    def new_value(self, aval) -> Value:
        self.counter += 1
        return Value(aval, f"%{self.counter}")

    def const_operand(self, val, aval):
        if getattr(aval, "shape", None) == () or not hasattr(val, "shape"):
            return Const(val, aval)
        v = self.new_value(aval)
        self.consts.append((v, val))
        return v

    def sub_program(self, j, scope: str = "") -> Program:
        jaxpr, vals = (j.jaxpr, j.consts) if isinstance(j, core.ClosedJaxpr) else (j, [])
        invars = [self.new_value(v.aval) for v in jaxpr.invars]
        eqns: list[Eqn] = []
        outvars = self.walk(jaxpr, vals, invars, eqns, scope)
        return Program(invars, outvars, eqns, [])

    def walk(self, jaxpr: core.Jaxpr, const_vals, in_operands, eqns: list, scope: str = "",
             placed: Optional[tuple[str, int]] = None) -> list:
        """placed: where the ops of a compute_on body compute and which call it is (JAX 0.11+); JAX 0.10's ops
        carry the first in ctx."""
        env: dict = {}

        def read(a):
            if isinstance(a, core.Literal):
                return Const(a.val, a.aval)
            return env[a]

        for var, val in zip(jaxpr.constvars, const_vals):
            env[var] = self.const_operand(val, var.aval)
        for var, op in zip(jaxpr.invars, in_operands):
            env[var] = op
        for eqn in jaxpr.eqns:
            ins = [read(a) for a in eqn.invars]
            key = CALL_PRIMITIVES.get(eqn.primitive.name)
            if eqn.primitive.name == "remat2":
                outs = self.region(eqn, ins, eqns, scope, placed)
            elif key is not None and key in eqn.params:
                outs = self.call(eqn, eqn.params[key], ins, eqns, scope, placed)
            else:
                outs = [self.new_value(v.aval) for v in eqn.outvars]
                bodies = BODIES[eqn.primitive.name](eqn.params) if eqn.primitive.name in BODIES else {}
                inner = _scope(eqn.source_info, scope) if bodies else ""
                subs = {name: self.sub_program(j, inner) for name, j in bodies.items()}
                eqns.append(Eqn(eqn.primitive, ins, outs, dict(eqn.params), (eqn.source_info, scope), len(eqns),
                                subs, *(placed or (getattr(eqn.ctx, "compute_type", None), -1))))
            for var, out in zip(eqn.outvars, outs):
                if not isinstance(var, core.DropVar):
                    env[var] = out
        return [read(a) for a in jaxpr.outvars]

    def region(self, eqn, ins: list, eqns: list, scope: str, placed) -> list:
        """A checkpointed region: one Eqn whose body holds its ops (their values are the caller's)."""
        body_eqns: list[Eqn] = []
        outs = self.walk(eqn.params["jaxpr"], [], ins, body_eqns, _scope(eqn.source_info, scope), placed)
        produced = {v for e in body_eqns for v in e.outvars}
        made = list(dict.fromkeys(o for o in outs if isinstance(o, Value) and o in produced))
        body = Program(list(ins), outs, body_eqns, [])
        eqns.append(Eqn(eqn.primitive, ins, made, dict(eqn.params), (eqn.source_info, scope), len(eqns),
                        {"body": body}))
        return outs

    def call(self, eqn, sub, ins: list, eqns: list, scope: str, placed) -> list:
        """A call-like primitive (pjit, custom_jvp_call, compute_on, ...): its body inlined."""
        inner = _scope(eqn.source_info, scope)
        if eqn.primitive.name == "compute_on":
            self.regions += 1
            placed = (eqn.params["compute_type"], self.regions)
        if isinstance(sub, core.ClosedJaxpr):
            return self.walk(sub.jaxpr, sub.consts, ins, eqns, inner, placed)
        return self.walk(sub, [], ins, eqns, inner, placed)


def live_only(program: Program, needed: Sequence[bool]) -> Program:
    """The program with only the ops that make its needed results (an op without results is kept): what XLA's
    dead-code elimination leaves of a body run once, unrolled (a pipelined scan's peeled last trip)."""
    live = {x for x, n in zip(program.outvars, needed) if n and isinstance(x, Value)}
    return Program(program.invars, program.outvars, _live_eqns(program.eqns, live), program.consts)


def _live_eqns(eqns: Sequence[Eqn], live: set) -> list[Eqn]:
    """The ops making values in live (which grows by what they read), a checkpointed region's body pruned too
    (its values are the caller's, so XLA prunes it as inlined code)."""
    kept = []
    for e in reversed(eqns):
        if e.outvars and not any(v in live for v in e.outvars):
            continue
        if e.name == "remat2" and not all(v in live for v in e.outvars):
            body = e.subs["body"]
            e = dataclasses.replace(e, subs={**e.subs, "body": Program(body.invars, body.outvars,
                                                                        _live_eqns(body.eqns, live), body.consts)})
        kept.append(e)
        live.update(x for x in e.invars if isinstance(x, Value))
    return kept[::-1]


def uses(program: Program) -> dict:
    """How many times each value is read (by an equation or as a result), bodies included."""
    count: dict = {}

    def visit(p: Program) -> None:
        for x in p.outvars:
            if isinstance(x, Value):
                count[x] = count.get(x, 0) + 1
        for e in p.eqns:
            for x in e.invars:
                if isinstance(x, Value):
                    count[x] = count.get(x, 0) + 1
            for sub in e.subs.values():
                visit(sub)
    visit(program)
    return count


class Token:
    """A local value in a walk without arrays (Lowering.cost): only its identity matters."""
    __slots__ = ()
