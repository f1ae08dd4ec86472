"""The shape of the code, checked from its source: private JAX behind one module, and the style config."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBRARY = ("gshard_jax", "partitioner", "models", "benchmarks", "examples", "experiments")
COMPAT = os.path.join("partitioner", "jax_compat.py")


def _sources():
    for top in LIBRARY:
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    yield os.path.relpath(path, ROOT), path


def test_private_jax_is_imported_only_by_the_compat_module():
    """jax._src moves between releases: partitioner/jax_compat.py holds every private name, and says which
    JAX versions it was checked against."""
    found = []
    for rel, path in _sources():
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if re.search(r"\bjax\._src\b", line.split("#")[0]) and rel != COMPAT:
                    found.append(f"{rel}:{n}: {line.strip()}")
    assert not found, "\n".join(found)
    with open(os.path.join(ROOT, COMPAT)) as f:
        assert "Checked against JAX 0.10" in f.read()


def test_the_code_passes_the_ruff_config():
    """pyproject.toml's [tool.ruff]: line length and import order (and pyflakes' checks) hold everywhere. ruff
    comes with the test extras."""
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:]
