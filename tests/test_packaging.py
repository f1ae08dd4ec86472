"""Installing gshard-jax puts one top-level package on the path: gshard_jax."""
import os
import re
import subprocess
import sys

import pytest


def test_user_modules_named_partitioner_and_models_do_not_shadow(tmp_path):
    """A user's own partitioner.py and models/ package next to their script leave gshard_jax intact."""
    (tmp_path / "partitioner.py").write_text("raise ImportError('the user partitioner.py was imported')\n")
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "__init__.py").write_text("raise ImportError('the user models/ was imported')\n")
    code = ("import gshard_jax, gshard_jax.partitioner.rules.factor_rules, gshard_jax.models.lm\n"
            "import gshard_jax.models.moe\n"
            "print('gshard_jax imported')\n"
            "import partitioner\n")  # the user's own module must be the one `import partitioner` finds
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert r.stdout.strip() == "gshard_jax imported", r.stderr
    assert "the user partitioner.py was imported" in r.stderr, r.stderr


def test_no_top_level_partitioner_or_models_installed(tmp_path):
    """Outside the repository, only gshard_jax.partitioner / gshard_jax.models exist."""
    code = ("import importlib.util as u\n"
            "print(u.find_spec('partitioner'), u.find_spec('models'), u.find_spec('gshard_jax.partitioner').name)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["None", "None", "gshard_jax.partitioner"]


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _packages_on_disk() -> set:
    """Every folder with an __init__.py under the three source trees, by the name it is installed as."""
    found = set()
    for top, name in (("gshard_jax", "gshard_jax"), ("partitioner", "gshard_jax.partitioner"),
                      ("models", "gshard_jax.models")):
        for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            if "__init__.py" in files:
                rel = os.path.relpath(folder, os.path.join(ROOT, top))
                found.add(name if rel == "." else f"{name}.{rel.replace(os.sep, '.')}")
    return found


def test_setup_cfg_lists_every_package_the_sources_have():
    """setup.cfg lists the packages by hand: a sub-package left out is missing from a non-editable install
    (as the GPU machines install) while an editable one still finds it."""
    import configparser
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    listed = set(cfg["options"]["packages"].split())
    assert listed == _packages_on_disk(), listed ^ _packages_on_disk()


def test_a_non_editable_install_carries_every_package(tmp_path):
    """`pip install --target DIR .` (as the GPU machines install; no deps) puts every package's __init__.py
    under DIR. (Built from a copy of the sources: the build leaves nothing in the checkout.)"""
    import shutil
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__",
                                                                ".pytest_cache"))
    target = tmp_path / "target"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                        str(source)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    missing = [p for p in sorted(_packages_on_disk())
               if not (target / p.replace(".", os.sep) / "__init__.py").is_file()]
    assert not missing, missing


def test_partitioner_is_inside_the_namespace():
    import gshard_jax.models  # noqa: F401
    assert gshard_jax.partitioner.__name__ == "gshard_jax.partitioner"
    assert gshard_jax.models.__name__ == "gshard_jax.models"


def test_code_and_docs_cite_only_what_the_repository_has():
    """Docstrings and docs name their sources (docs/references.md), not files a reader does not have."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(["git", "ls-files", "*.py", "*.md", "*.cfg", "*.toml"], cwd=root, capture_output=True,
                         text=True).stdout.split()
    assert len(out) > 50 and "docs/references.md" in out
    for path in out:
        with open(os.path.join(root, path)) as f:
            text = f.read()
        assert not re.search(r"DESIGN\.md|REFERENCE\.md|REFERENCE (section|§)", text), path


@pytest.mark.newest_jax
def test_an_uninstalled_checkout_says_how_to_install_it():
    """Run from a checkout that no install maps (python -S: no .pth, so no editable finder), `import gshard_jax`
    finds the checkout's gshard_jax/ without its partitioner/: the error says so and how to fix it."""
    import jax
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    site = os.path.dirname(os.path.dirname(jax.__file__))
    code = f"import sys; sys.path.append({site!r}); import gshard_jax"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-S", "-c", code], cwd=root, capture_output=True, text=True, env=env)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: gshard_jax was imported from"), r.stderr[-2000:]
    assert f"pip install -e {root}" in last and "ModuleNotFoundError" not in r.stderr


@pytest.mark.newest_jax
def test_the_gpu_extras_bring_jaxs_cuda_build_over_the_supported_range():
    """README's `.[cuda12]` / `.[cuda13]`: JAX's own extras of those names (the installed JAX declares them), over
    install_requires' JAX range, so a GPU install never moves JAX outside what the suite tests."""
    import configparser
    from importlib.metadata import metadata
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(root, "setup.cfg"))
    (pin,) = [r for r in cfg["options"]["install_requires"].split() if r.startswith("jax>=")]
    declared = {r.split("extra ==")[1].strip().strip('"') for r in metadata("jax").get_all("Requires-Dist")
                if "extra ==" in r}
    for extra in ("cuda12", "cuda13"):
        assert cfg["options.extras_require"][extra].split() == [pin.replace("jax", f"jax[{extra}]", 1)]
        assert extra in declared, sorted(declared)


def test_the_newest_jax_run_is_pinned_inside_the_supported_range():
    """.ci/run's second run installs with constraints/newest-jax.txt, whose JAX is jax_compat.NEWEST_TESTED and
    lies in setup.cfg's range (so users can install it), every pin exact and of a package the install pulls."""
    import configparser

    from packaging.requirements import Requirement

    from gshard_jax.partitioner.representation.jax_compat import NEWEST_TESTED
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    requires = {Requirement(r).name: Requirement(r) for r in cfg["options"]["install_requires"].strip().splitlines()}
    with open(os.path.join(ROOT, "constraints", "newest-jax.txt")) as f:
        pins = [Requirement(line) for line in f.read().splitlines() if line.strip() and not line.startswith("#")]
    versions = {}
    for pin in pins:
        (spec,) = pin.specifier
        assert spec.operator == "==", pin  # exact: CI tests one named release
        versions[pin.name.replace("_", "-")] = spec.version
    assert versions["jax"] == versions["jaxlib"] == NEWEST_TESTED, versions
    for name, version in versions.items():
        if name in requires:
            assert requires[name].specifier.contains(version), (name, version, str(requires[name].specifier))
    assert {"jax", "flax", "optax", "orbax-checkpoint", "numpy"} <= set(versions) <= set(requires) | {
        "jaxlib", "ml-dtypes"}, versions
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        script = f.read()
    assert '-m pip install -q -c constraints/newest-jax.txt -e ".[test]"' in script
