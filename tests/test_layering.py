"""The shape of the code, checked from its source: private JAX behind one module, and the style config."""
import ast
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBRARY = ("gshard_jax", "partitioner", "models", "benchmarks", "examples", "experiments")
COMPAT = os.path.join("partitioner", "representation", "jax_compat.py")


def _sources():
    for top in LIBRARY:
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    yield os.path.relpath(path, ROOT), path


def test_private_jax_is_imported_only_by_the_compat_module():
    """jax._src moves between releases: partitioner/representation/jax_compat.py holds every private name, and
    says which JAX versions it was checked against."""
    found = []
    for rel, path in _sources():
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if re.search(r"\bjax\._src\b", line.split("#")[0]) and rel != COMPAT:
                    found.append(f"{rel}:{n}: {line.strip()}")
    assert not found, "\n".join(found)
    with open(os.path.join(ROOT, "setup.cfg")) as f:
        (pin,) = re.findall(r"^\s*(jax>=[^\s;]+)$", f.read(), re.M)
    with open(os.path.join(ROOT, COMPAT)) as f:
        assert f"(setup.cfg: {pin})" in f.read(), pin


def test_the_code_passes_the_ruff_config():
    """pyproject.toml's [tool.ruff]: line length and import order (and pyflakes' checks) hold everywhere. ruff
    comes with the test extras."""
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:]


# Layers, lowest first: each imports only from those before it (gshard_jax/__init__.py, the facade, is outside).
LAYERS = [
    ("partitioner", ["gshard_jax.partitioner"]),
    ("api", ["gshard_jax.annotations", "gshard_jax.passes", "gshard_jax.api", "gshard_jax.sources",
             "gshard_jax.specs", "gshard_jax.manual", "gshard_jax.mesh", "gshard_jax.targets"]),
    ("pipeline", ["gshard_jax.pipelines"]),
    ("models", ["gshard_jax.models"]),
    ("configs", ["gshard_jax.configs"]),
    ("training", ["gshard_jax.training"]),
    ("planner", ["gshard_jax.planner"]),
    ("cli", ["gshard_jax.cli"]),
]
INSTALLED_AS = {"gshard_jax": "gshard_jax", "partitioner": "gshard_jax.partitioner", "models": "gshard_jax.models"}


def _modules() -> dict:
    """{module name as installed: path} of the package's sources."""
    out = {}
    for top, name in INSTALLED_AS.items():
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith(".py"):
                    parts = [name] + os.path.relpath(os.path.join(folder, f), os.path.join(ROOT, top)).split(os.sep)
                    parts[-1] = parts[-1][:-3]
                    out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = os.path.join(folder, f)
    return out


def _layer(module: str):
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return None


def _imports(module: str, path: str):
    """(imported module, line) for every import in the file, at any depth (a function-level one too)."""
    package = module.split(".") if path.endswith("__init__.py") else module.split(".")[:-1]
    with open(path) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            yield base, node.lineno
            for a in node.names:
                yield f"{base}.{a.name}", node.lineno


def _upward(modules: dict, rank, name) -> list[str]:
    """Every import, function-level ones included, of a module ranked lower (rank: module -> its rank or None)
    than the module it imports; name: a rank's name, for the message."""
    upward = set()
    for module, path in sorted(modules.items()):
        mine = rank(module)
        for target, line in _imports(module, path):
            theirs = rank(target) if target in modules else None
            if mine is not None and theirs is not None and theirs > mine:
                upward.add(f"{module} ({name(mine)}) imports {target} ({name(theirs)}), line {line}")
    return sorted(upward)


def test_every_layer_imports_only_from_the_layers_before_it():
    """partitioner -> API -> pipeline -> models -> configs -> training -> planner -> cli, read from every
    import in the sources, function-level ones included (none dodges the order)."""
    modules = _modules()
    assert all(_layer(m) is not None for m in modules if m != "gshard_jax"), \
        [m for m in modules if m != "gshard_jax" and _layer(m) is None]
    upward = _upward(modules, _layer, lambda k: LAYERS[k][0])
    assert not upward, "\n".join(upward)


def test_the_layering_check_sees_an_upward_import(tmp_path):
    """The check reads function-level imports: a configs module importing training inside a function is caught."""
    path = tmp_path / "configs.py"
    path.write_text("def f():\n    from .training import train\n")
    found = [t for t, _ in _imports("gshard_jax.configs", str(path))]
    assert "gshard_jax.training" in found and _layer("gshard_jax.training") > _layer("gshard_jax.configs")


def _circles(edges: dict) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _package_edges(modules: dict) -> dict:
    """module -> the modules of its own package it imports (at any depth, type-checking imports too); a
    package's __init__ (its facade) is left out."""
    inits = {m for m, path in modules.items() if path.endswith("__init__.py")}
    edges = {}
    for module, path in modules.items():
        if module in inits:
            continue
        parent = module.rsplit(".", 1)[0]
        edges[module] = {t for t, _ in _imports(module, path) if t in modules and t not in inits and t != module
                         and t.rsplit(".", 1)[0] == parent}
    return edges


def test_no_package_imports_itself_in_a_circle():
    """Inside each package the modules import one another in one order (the partitioner's program
    representation at the bottom, its passes and strategies above), function-level imports included: no
    circle, so every package reads bottom-up."""
    circles = _circles(_package_edges(_modules()))
    assert not circles, "\n".join(" <-> ".join(c) for c in circles)


def _phase(module: str):
    """The partitioner phase (sub-package) a module is in, or None."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["gshard_jax", "partitioner"] else None


def test_the_partitioners_modules_live_in_its_phases_folders():
    """Every partitioner module is in one phase's folder (only the facade at the top), every folder is a phase
    of PHASES (lowest first), and each phase's __init__ says what it holds and what it may import."""
    from gshard_jax.partitioner import PHASES
    top = os.path.join(ROOT, "partitioner")
    loose = [f for f in os.listdir(top) if f.endswith(".py") and f != "__init__.py"]
    assert not loose, loose
    folders = {d for d in os.listdir(top) if os.path.isdir(os.path.join(top, d)) and d != "__pycache__"}
    assert folders == set(PHASES), folders ^ set(PHASES)
    for phase in PHASES:
        with open(os.path.join(top, phase, "__init__.py")) as f:
            doc = " ".join((ast.get_docstring(ast.parse(f.read())) or "").split())
        assert "Holds" in doc and ("May import" in doc or "Imports nothing" in doc), (phase, doc)


def test_each_partitioner_phase_imports_only_from_itself_and_the_phases_before_it():
    """Read from every import in the partitioner's sources, function-level ones included: the program
    representation imports no rule, no strategy a propagation, nothing below the automatic sharding imports
    it."""
    from gshard_jax.partitioner import PHASES
    rank = lambda m: None if _phase(m) is None else PHASES.index(_phase(m))
    upward = _upward(_modules(), rank, lambda k: PHASES[k])
    assert not upward, "\n".join(upward)


def test_the_phase_check_sees_an_upward_import(tmp_path):
    """A representation module importing the lowering inside a function is an upward import."""
    path = tmp_path / "program.py"
    path.write_text("def f():\n    from ..lowering import lower\n")
    found = [t for t, _ in _imports("gshard_jax.partitioner.representation.program", str(path))]
    from gshard_jax.partitioner import PHASES
    assert "gshard_jax.partitioner.lowering.lower" in found
    assert PHASES.index(_phase("gshard_jax.partitioner.lowering.lower")) > PHASES.index("representation")


def test_the_circle_check_sees_a_function_level_circle(tmp_path):
    """Two modules that import each other, one of them inside a function, are a circle; an import from
    another package or of the package's facade is not an edge."""
    (tmp_path / "a.py").write_text("def f():\n    from . import b\n")
    (tmp_path / "b.py").write_text("from .a import f\nfrom .. import other\n")
    (tmp_path / "c.py").write_text("from . import a\n")
    modules = {f"p.{n}": str(tmp_path / f"{n}.py") for n in "abc"}
    assert _circles(_package_edges(modules)) == [["p.a", "p.b"]]
    assert _circles({"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}}) == [["p.a", "p.b", "p.c"]]


def test_every_case_slow_cases_lists_is_a_test():
    """tests/slow_cases.txt (the heaviest cases, marked slow by conftest.py) names tests that exist: a renamed
    test would otherwise drop back into the default suite, unnoticed."""
    with open(os.path.join(ROOT, "tests", "slow_cases.txt")) as f:
        ids = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    assert len(ids) == len(set(ids)) and ids
    for node in ids:
        path, name = node.split("::")
        with open(os.path.join(ROOT, path)) as f:
            assert re.search(rf"^def {re.escape(name.split('[')[0])}\(", f.read(), re.M), node
