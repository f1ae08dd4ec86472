"""Random programs (tests/random_programs.py writes them): gs.partition(fn, mesh) must give the numbers
jax.jit(fn) gives.

A failure prints a runnable reproduction: ``python tests/test_random_programs.py --show SEED``. Run many
seeds with ``python tests/test_random_programs.py START COUNT`` (one line per failing program and a summary).

When the partitioned result differs from jax.jit(fn) but equals fn run op by op, jax.jit itself was wrong
(XLA:CPU folds a gather or dynamic_slice of a clamped dynamic_slice without the clamp, e.g.
``jnp.take(lax.dynamic_slice(arange(8), (3,), (6,)), 0)`` gives 3 under jax.jit, 2 op by op): such a
program is reported as "oracle" with a warning, not as a partitioner failure.

Kinds of outcome (run_program): ok, wrong (values, dtype or shape differ), crash (an exception other than
ValueError), rejection (a ValueError for a program whose annotations are all valid: a false rejection),
hang (no result within PROGRAM_TIMEOUT_S), generator (the program is invalid: a bug of the generator),
oracle.
"""
from __future__ import annotations

import signal
import sys
import threading
import time
import traceback
import warnings

import jax

if __name__ == "__main__":  # pytest's conftest.py does this for the test runs
    jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import gshard_jax as gs  # noqa: E402
from random_programs import MESHES, B, F, I, Program, generate_program  # noqa: E402

DEFAULT_SEEDS = range(40)
SLOW_START, SLOW_CHUNK, SLOW_CHUNKS = 100_000, 100, 10
PROGRAM_TIMEOUT_S = 120

# --------------------------------------------------------------------------- running


_MESH_CACHE: dict = {}


def mesh_for(name: str):
    if name not in _MESH_CACHE:
        _MESH_CACHE[name] = gs.make_mesh(MESHES[name])
    return _MESH_CACHE[name]


class ProgramTimeout(Exception):
    pass


def _alarm(_signum, _frame):
    raise ProgramTimeout(f"no result within {PROGRAM_TIMEOUT_S} s")


def compare(got, want) -> str | None:
    """None when equal: same tree, dtypes and shapes; ints and bools exactly, floats to rtol = atol = 1e-5."""
    gl, wl = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    if jax.tree_util.tree_structure(got) != jax.tree_util.tree_structure(want):
        return f"output structure {jax.tree_util.tree_structure(got)} != {jax.tree_util.tree_structure(want)}"
    for k, (o, w) in enumerate(zip(gl, wl)):
        o, w = np.asarray(o), np.asarray(w)
        if o.dtype != w.dtype or o.shape != w.shape:
            return f"output {k}: got {o.dtype}{list(o.shape)}, want {w.dtype}{list(w.shape)}"
        try:
            if np.issubdtype(w.dtype, np.floating):
                np.testing.assert_allclose(o, w, rtol=1e-5, atol=1e-5)
            else:
                np.testing.assert_array_equal(o, w)
        except AssertionError as e:
            bad = np.argwhere(~np.isclose(o, w, rtol=1e-5, atol=1e-5, equal_nan=True)
                              if np.issubdtype(w.dtype, np.floating) else o != w)
            return (f"output {k}: {len(bad)} of {w.size} elements differ, first at {tuple(bad[0]) if len(bad) else ()}"
                    f"\n  got  {np.array2string(o.ravel()[:24], precision=4)}\n  want "
                    f"{np.array2string(w.ravel()[:24], precision=4)}\n{str(e).strip()[:600]}")
    return None


def _partition_frame(tb) -> str:
    """The innermost traceback frame inside partitioner/ or gshard_jax/ (where the partitioner failed)."""
    frames = traceback.extract_tb(tb)
    mine = [f for f in frames if "/partitioner/" in f.filename or "/gshard_jax/" in f.filename]
    f = (mine or frames)[-1] if frames else None
    return f"{f.filename.split('/main/')[-1]}:{f.lineno} in {f.name}" if f else "?"


def fn_eager(p: Program):
    """fn run op by op (no jax.jit around it): a second opinion when jax.jit(fn) and the partitioned result differ."""
    out = p.fn(*p.args)
    jax.block_until_ready(out)
    return out


def run_program(seed: int) -> tuple[str, str, Program | None]:
    """(kind, detail, program): kind is ok | wrong | crash | rejection | hang | generator (a generator bug)
    | oracle (jax.jit(fn) itself is wrong: the partitioned result equals fn run op by op)."""
    try:
        p = generate_program(seed)
    except Exception as e:  # noqa: BLE001
        return "generator", f"generate({seed}) raised {type(e).__name__}: {e}\n{traceback.format_exc()}", None
    try:
        want = jax.jit(p.fn)(*p.args)
        jax.block_until_ready(want)
    except Exception as e:  # noqa: BLE001
        return "generator", f"the unpartitioned program raised {type(e).__name__}: {e}", p
    use_alarm = threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGALRM")
    if use_alarm:
        old = signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(PROGRAM_TIMEOUT_S)
    try:
        f = gs.partition(p.fn, mesh_for(p.mesh_name), in_shardings=p.in_shardings, out_shardings=p.out_shardings)
        got = f(*p.args)
        jax.block_until_ready(got)
    except ProgramTimeout as e:
        return "hang", str(e), p
    except ValueError as e:
        return "rejection", f"ValueError: {e}\n  at {_partition_frame(e.__traceback__)}", p
    except Exception as e:  # noqa: BLE001
        return "crash", f"{type(e).__name__}: {str(e)[:1500]}\n  at {_partition_frame(e.__traceback__)}", p
    finally:
        if use_alarm:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
    diff = compare(got, want)
    if not diff:
        return "ok", "", p
    # jax.jit's own compile of the unpartitioned program can be wrong (XLA CPU folds nested dynamic_slices with
    # the wrong clamp): when op-by-op execution agrees with the partitioned result instead, the oracle erred.
    try:
        eager = fn_eager(p)
    except Exception:  # noqa: BLE001
        eager = None
    if eager is not None and compare(got, eager) is None and compare(want, eager) is not None:
        return "oracle", "jax.jit(fn) disagrees with fn run op by op, which the partitioned result equals:\n" + diff, p
    return "wrong", diff, p


def run_seeds(seeds, log=None) -> tuple[dict, list]:
    counts: dict = {}
    failures = []
    for seed in seeds:
        if log:
            log(f"seed {seed}")
        kind, detail, p = run_program(seed)
        counts[kind] = counts.get(kind, 0) + 1
        if kind != "ok":
            failures.append((seed, kind, detail, p.description if p else ""))
    return counts, failures


def _report(failures) -> str:
    return "\n\n".join(f"=== seed {seed}: {kind}\n{detail}\n--- reproduce:\n{desc}"
                       for seed, kind, detail, desc in failures)


# --------------------------------------------------------------------------- tests


def test_generator_is_deterministic_and_tracks_shapes():
    """The generator's own bookkeeping: the same seed gives the same program; outputs have the shapes it says."""
    for seed in range(10):
        a, b = generate_program(seed), generate_program(seed)
        assert a.description == b.description
        out = jax.tree_util.tree_leaves(jax.eval_shape(a.fn, *a.args))
        want = [(tuple(s), {F: "float32", I: "int32", B: "bool"}[d]) for s, d in a.out_avals]
        assert [(o.shape, str(o.dtype)) for o in out] == want, a.description


@pytest.mark.parametrize("seed", list(DEFAULT_SEEDS))
def test_random_program(seed):
    kind, detail, p = run_program(seed)
    if kind == "oracle":  # not the partitioner's failure, but say so
        warnings.warn(f"seed {seed}: {detail}\n{p.description}")
        return
    assert kind == "ok", f"seed {seed}: {kind}\n{detail}\n--- reproduce:\n{p.description if p else ''}"


@pytest.mark.slow
@pytest.mark.parametrize("chunk", range(SLOW_CHUNKS))
def test_random_programs_many(chunk):
    seeds = range(SLOW_START + chunk * SLOW_CHUNK, SLOW_START + (chunk + 1) * SLOW_CHUNK)
    counts, failures = run_seeds(seeds)
    for seed, kind, detail, desc in failures:
        if kind == "oracle":
            warnings.warn(f"seed {seed}: {detail}\n{desc}")
    failures = [f for f in failures if f[1] != "oracle"]
    assert not failures, f"{counts}\n" + _report(failures)


def _main(argv) -> None:
    if argv[:1] == ["--show"]:
        for s in argv[1:]:
            print(generate_program(int(s)).description)
        return
    start, count = int(argv[0]), int(argv[1])
    t0 = time.time()
    counts: dict = {}
    for seed in range(start, start + count):
        print(f"@ {seed}", flush=True)
        t = time.time()
        kind, detail, p = run_program(seed)
        counts[kind] = counts.get(kind, 0) + 1
        print(f"# {seed} {kind} {time.time() - t:.2f}s {p.mesh_name if p else ''} "
              f"{','.join(p.ops) if p else ''}", flush=True)
        if kind != "ok":
            print(_report([(seed, kind, detail, p.description if p else "")]), flush=True)
    print(f"SUMMARY {counts} in {time.time() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    _main(sys.argv[1:])
