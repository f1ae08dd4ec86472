"""Compile targets (gshard_jax/targets) and `gshard-jax compile`: a config's train step compiled for TPU, GPU and
CPU devices this machine does not have. The TPU cases run where libtpu is installed (README: `.[tpu]`, as
.ci/run installs it), the GPU ones where JAX's CUDA plugin is (`.[cuda12]`, slow)."""
import importlib.util
import json
import math

import jax
import pytest

from gshard_jax import configs, targets as TG
from gshard_jax.cli import main
from gshard_jax.training import aot, fit, train

HAS_TPU = importlib.util.find_spec("libtpu") is not None
HAS_GPU = any(importlib.util.find_spec(f"jax_cuda{v}_plugin") for v in (12, 13))
GiB = 2 ** 30


def test_a_target_names_a_compiler_device_and_topology():
    for text, count in [("tpu:v5p:2x2x2", 8), ("tpu:v3:4x4", 32), ("tpu:v5e:2x2", 4), ("gpu:h100:1x1x8", 8),
                        ("gpu:a100-40:1x512x8", 4096), ("cpu:8", 8)]:
        t = TG.parse(text)
        assert str(t) == text and t.count == count, (t, t.count)
    assert TG.parse("TPU:V5P:2x2x2") == TG.parse("tpu:v5p:2x2x2")


@pytest.mark.parametrize("text,says", [
    ("npu:x:1", "expected a compiler of ['tpu', 'gpu', 'cpu']"),
    ("tpu:v9:2x2", "no TPU named 'v9'; expected one of ['v3', 'v4', 'v5e', 'v5p', 'v6e']"),
    ("gpu:h100:8", "expected SLICESxHOSTSxGPUS, as 1x1x8"),
    ("gpu:rtx:1x1x8", "no GPU named 'rtx'"),
    ("tpu:v5p", "expected tpu:DEVICE:TOPOLOGY"),
    ("cpu:0", "expected cpu:N"),
])
def test_a_bad_target_says_what_was_expected(text, says):
    with pytest.raises(ValueError, match=None) as e:
        TG.parse(text)
    assert says in str(e.value) and repr(text) in str(e.value), str(e.value)


def test_the_gpu_descriptions_are_xlas_published_devices():
    """Each GPU's data file holds the device XLA:GPU compiles for: its name and memory as XLA's spec gives them."""
    memory = {"h100": 84942979072, "h200": 151397597184, "a100-40": 42331013120, "a100-80": 85100068864,
              "b200": 191514411008}
    names = {"h100": "H100 80GB", "h200": "H200 141GB", "a100-40": "A100-SXM4-40GB", "a100-80": "A100-SXM4-80GB",
             "b200": "B200"}
    assert set(TG.GPU_SPECS) == set(memory)
    for gpu, size in memory.items():
        t = TG.parse(f"gpu:{gpu}:1x1x8")
        assert t.memory_bytes == size
        spec = TG.gpu_spec(gpu)
        assert f'device_description_str: "NVIDIA {names[gpu]}' in spec and 'platform_name: "CUDA"' in spec
    assert TG.parse("tpu:v3:8x8").memory_bytes == 16 * GiB and TG.parse("cpu:8").memory_bytes is None


def test_a_missing_compiler_names_what_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "libtpu" or name.startswith("jax_cuda") else real(name, *a))
    with pytest.raises(TG.MissingCompiler, match=rf'pip install "jax\[tpu\]=={jax.__version__}"'):
        TG.parse("tpu:v5p:2x2x2").devices()
    with pytest.raises(TG.MissingCompiler, match=rf'pip install "jax\[cuda12\]=={jax.__version__}"'):
        TG.parse("gpu:h100:1x1x8").devices()


def test_a_cpu_target_is_the_simulated_devices(capsys):
    """cpu:8 compiles the step `train` runs here: the same memory as the memory check's (fit.step_memory)."""
    cfg = configs.load("experiments/tiny_dense_lm.py")
    assert main(["compile", "--config", "experiments/tiny_dense_lm.py", "--target", "cpu:8", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = fit.step_memory(train.Trainer(configs.typed(cfg), ""))
    assert got["memory"]["total"] == want.total and got["fits"] and got["mesh"] == {"data": 8}, got
    with pytest.raises(ValueError, match="this process has 8 CPU devices"):
        TG.parse("cpu:16").devices()


@pytest.mark.skipif(not HAS_TPU, reason="XLA:TPU (libtpu) is not installed: pip install -e '.[tpu]'")
def test_a_tpu_target_compiles_the_moe_step_with_its_all_to_alls():
    """tiny_moe_lm on 8 v5p chips: XLA:TPU's compile-only devices, the config's mesh over them, the dispatch's
    all-to-alls in the compiled step, the memory XLA:TPU holds (bf16 as bf16: not XLA:CPU's), and the step
    refused where the chip's memory does not hold it."""
    cfg = configs.load("experiments/tiny_moe_lm.py")
    target = TG.parse("tpu:v5p:2x2x2")
    devices = target.devices()
    assert len(devices) == 8 and {d.platform for d in devices} == {"tpu"} and "v5" in devices[0].device_kind.lower()
    got = aot.compile_step(cfg, target)
    assert got.mesh == {"data": 2, "expert": 4} and got.fits and got.limit == 95 * GiB
    assert got.collectives["all-to-all"]["count"] > 0 and got.collectives["all-reduce"]["count"] > 0
    assert 0 < got.memory.total < GiB and got.memory.params > 0
    lines = "\n".join(got.lines())
    assert "fits in 95.00 GiB" in lines and "all-to-all x" in lines, lines


@pytest.mark.skipif(not HAS_TPU, reason="XLA:TPU (libtpu) is not installed: pip install -e '.[tpu]'")
def test_a_step_over_the_chips_memory_is_refused_and_the_cli_says_so(capsys):
    args = ["compile", "--config", "experiments/tiny_dense_lm.py", "--target", "tpu:v5e:2x4",
            "--config.train.batch_size=4096", "--config.train.seq_len=2048"]
    assert main(args) == 4
    out, err = capsys.readouterr()
    assert "does not fit" in out and "RESOURCE_EXHAUSTED" in out and "will not fit on tpu:v5e:2x4" in err, (out, err)
    needed, available = aot.refused_sizes(out)
    assert needed > available > 15 * GiB and f"{fit.size(needed)} of temporaries in {fit.size(available)}" in out
    assert "no configuration of these devices fits" in err or "microbatches" in err, err


def test_xla_tpus_refusal_gives_the_sizes():
    text = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries "
            "(179.33G) exceeds available HBM (15.75G).")
    assert aot.refused_sizes(text) == (179.33 * GiB, 15.75 * GiB)
    assert aot.refused_sizes("RESOURCE_EXHAUSTED: no sizes here") == (None, None)


@pytest.mark.slow  # 15-30 s a target; needs JAX's CUDA plugin (about 3-4 GB)
@pytest.mark.skipif(not HAS_GPU, reason="XLA:GPU (JAX's CUDA plugin) is not installed: pip install -e '.[cuda12]'")
@pytest.mark.parametrize("gpu", list(TG.GPU_SPECS))
def test_each_gpu_target_compiles_a_train_step(gpu):
    target = TG.parse(f"gpu:{gpu}:1x2x4")
    got = aot.compile_step(configs.load("experiments/tiny_dense_lm.py"), target)
    assert got.mesh == {"data": 8} and got.fits and got.step_s is None
    assert math.isclose(got.limit, 0.75 * target.memory_bytes) and 0 < got.memory.total < GiB


def test_plan_compiles_for_a_target_only_of_its_device_count(capsys):
    args = ["plan", "--config", "experiments/tiny_dense_lm.py", "--devices", "16", "--target", "tpu:v5p:2x2x2"]
    assert main(args) == 2
    assert "needs --check-memory K and --devices 8 (the target's devices; got 16)" in capsys.readouterr().err


@pytest.mark.slow  # 30-60 s: a plan, then its #1 compiled by XLA:TPU in a child process
@pytest.mark.skipif(not HAS_TPU, reason="XLA:TPU (libtpu) is not installed: pip install -e '.[tpu]'")
def test_plan_check_memory_compiles_its_top_candidate_for_a_tpu_target(capsys):
    """`plan --check-memory 1 --target tpu:v5p:2x2x2`: the plan's #1 compiled by XLA:TPU in the child, while this
    process may hold libtpu too (ALLOW_MULTIPLE_LIBTPU_LOAD), its compiled memory the in-process compile's."""
    TG.parse("tpu:v5p:2x2x2").devices()  # this process loads libtpu first
    args = ["plan", "--config", "experiments/tiny_dense_lm.py", "--devices", "8", "--top", "1", "--check-memory", "1",
            "--target", "tpu:v5p:2x2x2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "the top 1 compiled for tpu:v5p:2x2x2" in out, out[-2000:]
    line = next(x for x in out.splitlines() if x.startswith("  #1 "))
    want = aot.compile_step(configs.load("experiments/tiny_dense_lm.py"), TG.parse("tpu:v5p:2x2x2")).memory.total
    assert f"compiled {fit.size(want)}" in line, (line, fit.size(want))
