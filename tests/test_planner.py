"""The planner: AxoNN's published model reproduced, rejections with one reason, deterministic output, and the
partitioner's predictions for planned candidates equal to the compiled train step."""
import collections
import dataclasses
import json
import os
import re

import jax
import pytest

from gshard_jax import cli, configs
from gshard_jax.partitioner.costs import compilers
from gshard_jax.partitioner.reporting.hlo import collective_stats
from gshard_jax.planner import PROFILES, axonn, estimate as E, hardware, plan, predict as PR, space as SP
from gshard_jax.training.train import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU = PROFILES["cpu-simulation"]


def _config(name: str):
    cfg = configs.load(os.path.join(ROOT, "experiments", f"{name}.py"))
    cfg.train.update(dict(seq_len=16, batch_size=16))
    cfg.model.vocab_size = 512
    return cfg


@pytest.mark.parametrize("case", ["gpt_20b_32", "gpt_40b_64", "gpt_80b_4096"])
def test_axonn_mode_ranks_as_the_published_model(case):
    """Top 20 (Gr, Gc, Gd, Gdata) in the same order, times to 1e-9 relative, against the output of AxoNN's
    own comm_model.py on these inputs (tests/data/axonn_published.json says how it was made)."""
    with open(os.path.join(ROOT, "tests", "data", "axonn_published.json")) as f:
        want = json.load(f)[case]
    got = axonn.rank(PROFILES["perlmutter-a100"], want["batch"], want["seq"], want["layers"], want["hidden"],
                     want["gpus"], want["min_tp"], top=20)
    assert [(g.gr, g.gc, g.gd, g.gdata) for g in got] == [tuple(r[:4]) for r in want["rows"]]
    for g, r in zip(got, want["rows"]):
        assert g.seconds == pytest.approx(r[4], rel=1e-9, abs=0)


def test_hierarchical_bandwidth_is_the_table_inside_a_node_and_eq7_across():
    hw = PROFILES["perlmutter-a100"]  # 4 GPUs per node
    order = (("data", 8), ("y", 2), ("x", 2))  # x innermost
    assert hardware.axes_bandwidth(hw, order, ("x",)) == 76e9  # table: ip 1, size 2
    assert hardware.axes_bandwidth(hw, order, ("y",)) == 76e9  # table: ip 2, size 2 (span 4: one node)
    assert hardware.axes_bandwidth(hw, order, ("y", "x")) == 225e9  # ip 1, size 4
    assert hardware.axes_bandwidth(hw, order, ("data",)) == 100e9 / 4  # crosses nodes: beta / min(4, ip 4)
    assert hardware.axes_bandwidth(hw, (("x", 2), ("data", 8)), ("data",)) == 100e9 / 1  # ip 1 across nodes


def _moved(comms, c: SP.Candidate) -> collections.Counter:
    """Bytes moved per device by (kind, axes of size > 1)."""
    out = collections.Counter()
    for cm in comms:
        out[(cm.kind, tuple(sorted(a for a in cm.axes if c.size(a) > 1)))] += cm.moved
    return out


def _moved_by_formula_and_plan(cfg, c: SP.Candidate, planned_comms=None) -> tuple[collections.Counter,
                                                                                   collections.Counter]:
    """Bytes moved per device by (kind, axes of size > 1): the formula's, and the planned program's (its
    collectives appended to `planned_comms` where given)."""
    comms = PR.comms(PR.explain(cfg, c, CPU))
    if planned_comms is not None:
        planned_comms.extend(comms)
    return _moved(E.collectives(SP.model_shape(cfg), c), c), _moved(comms, c)


@pytest.mark.parametrize("mesh", [(("data", 2), ("expert", 4)), (("data", 2), ("expert", 2), ("x", 2))])
def test_the_screen_follows_the_dropless_region(mesh):
    """The formula's dropless MoE terms against the planned program: the all-to-all's worst-case buffers and
    the expert-weight gradients all-reduced once per step over data (the only all-reduce over data alone)
    come within 1% of the planned bytes."""
    cfg = _config("tiny_moe_lm")
    cfg.model.moe.dispatch = "dropless"
    c = SP.Candidate(mesh, zero_stage=0, microbatches=1)
    shape = SP.model_shape(cfg)

    formula, planned = _moved(E.collectives(shape, c), c), _moved(PR.comms(PR.explain(cfg, c, CPU)), c)
    for key in (("all-to-all", ("expert",)), ("all-reduce", ("data",))):
        assert formula[key] == pytest.approx(planned[key], rel=0.01), key


def test_the_formula_prices_the_exchange_the_platform_runs():
    """A dropless layer's expert exchange by formula: on a GPU profile ("auto": ragged) each routed row once,
    a 1/peers share of the dense all-to-all's worst-case buffers on CPU, in a pipeline's vmapped stages
    as outside them."""
    cfg = _config("tiny_moe_lm")
    cfg.model.moe.dispatch = "dropless"

    def exchanged(platform, c):
        shape = SP.model_shape(cfg, platform)
        return shape.exchange, sum(cm.moved for cm in E.collectives(shape, c) if cm.kind == "all-to-all")
    flat = SP.Candidate((("data", 2), ("expert", 4)), zero_stage=0, microbatches=1)
    (gpu, ragged), (cpu, dense) = exchanged("gpu", flat), exchanged("cpu", flat)
    assert (gpu, cpu) == ("ragged", "all_to_all") and ragged * 4 == pytest.approx(dense)
    staged = SP.Candidate((("stage", 2), ("data", 2), ("expert", 2)), zero_stage=0, microbatches=2,
                          schedule="1f1b")
    (gpu, ragged), (cpu, dense) = exchanged("gpu", staged), exchanged("cpu", staged)
    assert (gpu, cpu) == ("ragged", "all_to_all") and ragged * 2 == pytest.approx(dense) and ragged > 0


@pytest.mark.parametrize("mesh,opts", [
    ((("data", 2), ("context", 4)), {}), ((("data", 2), ("context", 2), ("y", 2)), {}),
    ((("stage", 2), ("context", 2), ("data", 2)), dict(microbatches=4, schedule="1f1b")),
    ((("stage", 2), ("context", 4)), dict(microbatches=2, schedule="gpipe")),
    ((("stage", 2), ("context", 2), ("data", 2)), dict(microbatches=4, schedule="circular", repeats=2))])
def test_the_screen_follows_the_ring_over_context(mesh, opts):
    """Context parallelism's formula against the planned program: ring attention's K/V permutes (its forward
    ring and its custom backward, each trip counted, on every forward tick of a pipeline) equal the planned
    bytes, and every weight gradient is summed over context too."""
    cfg = _config("tiny_dense_lm")
    cfg.train.seq_len = 64
    c = SP.Candidate(mesh, **dict(dict(zero_stage=0, microbatches=1), **opts))
    formula, planned = _moved_by_formula_and_plan(cfg, c)
    assert formula[("collective-permute", ("context",))] == pytest.approx(
        planned[("collective-permute", ("context",))], rel=1e-3)
    grads = ("all-reduce", tuple(sorted(a for a in ("context", "data") if c.size(a) > 1)))
    assert formula[grads] == pytest.approx(planned[grads], rel=1e-3)
    assert SP.mesh_reason(SP.model_shape(cfg), dict(c.sizes, context=3)) is not None  # 64 tokens: no 6 zigzag chunks


def test_context_is_screened_only_where_data_cannot_take_its_place():
    """A context axis is dominated where data in its place runs and fits (the same tokens per device and
    gradient sums, no ring): with 16 sequences only pipelines whose microbatches would not split over data x
    context are costed; with 2, only meshes whose batch would not. A pinned context mesh is costed and ranked
    whatever dominates it."""
    cfg = _config("tiny_dense_lm")
    cfg.train.seq_len = 64

    def twin_cannot_run(c, batch):  # data x context shards tokens as c does; m' <= m microbatches without stages
        return batch % (c.token_shards * (c.microbatches if c.size("stage") > 1 else 1)) != 0

    many = plan(cfg, 8, CPU, top=0, verify=0, remats=("none",))
    kept = [r.candidate for r in many.screened if r.candidate.size("context") > 1]
    assert kept and all(c.size("stage") > 1 and twin_cannot_run(c, 16) for c in kept)
    cfg.train.batch_size = 2
    pin = {"data": 1, "context": 2, "y": 4}
    few = plan(cfg, 8, CPU, top=1, verify=1, remats=("none",), pin=[pin])
    kept = [r.candidate for r in few.screened if r.candidate.size("context") > 1]
    assert kept and all(twin_cannot_run(c, 2) for c in kept if c.sizes != SP.Candidate(tuple(pin.items())).sizes)
    (_, rank, planned, _), = few.pinned
    assert rank is not None and planned is not None


@pytest.mark.parametrize("mesh,opts", [
    ((("stage", 2), ("data", 2), ("y", 2)), dict(microbatches=4, schedule="gpipe")),
    ((("stage", 2), ("data", 2), ("x", 2)), dict(microbatches=4, schedule="1f1b")),
    ((("stage", 4), ("data", 2)), dict(microbatches=4, schedule="1f1b")),
    ((("stage", 2), ("data", 4)), dict(microbatches=4, schedule="interleaved_1f1b", repeats=2))])
def test_the_screen_counts_a_pipelines_ticks(mesh, opts):
    """In a pipeline the formula counts what the schedule's table runs: the rolls between stages (1F1B's
    waves, its one-tick cooldown without one) equal the planned permutes, and a layer's collectives run on
    every forward tick, bubbles included."""
    cfg = _config("tiny_dense_lm")
    c = SP.Candidate(mesh, zero_stage=0, **opts)
    formula, planned = _moved_by_formula_and_plan(cfg, c)
    rolls = ("collective-permute", ("stage",))
    assert formula[rolls] == planned[rolls]
    if c.size("y") > 1:
        assert formula[("all-reduce", ("y",))] == pytest.approx(planned[("all-reduce", ("y",))], rel=1e-2)


@pytest.mark.parametrize("schedule,owned", [("gpipe", True), ("gpipe", False), ("1f1b", False), ("1f1b", True)])
def test_what_crosses_stages_once_a_step(schedule, owned):
    """docs/pipeline.md's per-step bytes over `stage` besides the permutes: with replicated ends the first
    stage's input gradient and the last stage's outputs (GPipe) or its head's gradient (1F1B), each
    all-reduced, as the formula counts them; nothing else of size. With stage-owned ends (the default, every
    schedule) the formula counts nothing and the program moves the scalar loss and metrics and the fault
    watcher's probe gradient (one float a row of the device's batch, made on the first stage) alone."""
    cfg = _config("tiny_dense_lm")
    cfg.pipeline.owned_ends = owned
    c = SP.Candidate((("stage", 4), ("data", 2)), zero_stage=0, microbatches=8, schedule=schedule)
    comms = []
    formula, planned = _moved_by_formula_and_plan(cfg, c, comms)
    ends = ("all-reduce", ("stage",))
    if owned:
        probe = 4 * cfg.train.batch_size // c.size("data") * 2 * (c.size("stage") - 1) / c.size("stage")
        over_stage = [cm.moved for cm in comms if _moved([cm], c)[ends]]
        assert formula[ends] == 0 and max(over_stage) == probe
        assert sum(over_stage) - probe < 100
    else:
        assert planned[ends] == pytest.approx(formula[ends], rel=1e-2) and formula[ends] > 1e4


@pytest.mark.parametrize("schedule,repeats", [("gpipe", 1), ("circular", 2), ("1f1b", 1)])
def test_a_pipelines_weight_gradients_are_reduce_scattered_under_zero(schedule, repeats):
    """ZeRO-1 in a pipeline: every schedule reduces the stage weights' gradients once per step by a
    reduce-scatter over data (the formula's bytes), with no gradient-sized all-reduce over data. The schedules
    that autodiff runs (GPipe, circular) had all-reduced them, the stacked weights' annotation constraining
    their cotangent to the weights' own layout."""
    cfg = _config("tiny_dense_lm")
    c = SP.Candidate((("stage", 2), ("data", 4)), zero_stage=1, microbatches=4, schedule=schedule, repeats=repeats)
    formula, planned = _moved_by_formula_and_plan(cfg, c)
    scatter = ("reduce-scatter", ("data",))
    assert planned[scatter] == pytest.approx(formula[scatter], rel=1e-2)
    assert planned[("all-reduce", ("data",))] < 1e-3 * formula[scatter], planned


@pytest.mark.parametrize("name,m,axis", [("tiny_dense_lm", 4, "y"), ("tiny_moe_lm", 1, "y"), ("tiny_dense_lm", 4, "x")])
def test_the_screen_follows_the_tensor_axes(name, m, axis):
    """The tensor axes' all-reduces by formula against the planned program. y: two per layer and pass (an MoE
    layer's FFN over its k x capacity slots per token), and the vocabulary's two per microbatch (the
    embedding's output, the head's input gradient). x: what contracts d_model (q, k, v, both SwiGLU inputs
    forward; the two output projections' input gradients backward), and the head's logits."""
    cfg = _config(name)
    c = SP.Candidate((("data", 4), (axis, 2)), zero_stage=0, microbatches=m)
    formula = sum(cm.moved for cm in E.collectives(SP.model_shape(cfg), c) if cm.kind == "all-reduce"
                  and cm.axes == (axis,))
    planned = sum(cm.moved for cm in PR.comms(PR.explain(cfg, c, CPU)) if cm.kind == "all-reduce"
                  and tuple(a for a in cm.axes if c.size(a) > 1) == (axis,))
    assert formula == pytest.approx(planned, rel=1e-2)


def test_a_pinned_mesh_is_planned_and_placed_in_the_ranking():
    """--rank-of: a paper's own mesh, planned whatever its formula rank, compared with #1; a mesh that cannot
    run says why; a mesh of the wrong size is refused."""
    cfg = _config("tiny_moe_lm")
    a = plan(cfg, 8, CPU, top=1, verify=1, remats=("none",), pin=[{"data": 8}, {"stage": 8}])
    (sizes, rank, r, why), (_, no_rank, none, reasons) = a.pinned
    assert sizes == {"data": 8} and r.candidate.sizes["data"] == 8 and r.estimate.source == "partitioner"
    assert a.screened[rank - 1].candidate.sizes == r.candidate.sizes
    assert all(x.candidate.sizes != r.candidate.sizes for x in a.screened[:rank - 1])  # its best variant's rank
    text = str(a)
    # Pruned meshes may hold candidates between the cut and a pinned mesh's slower best: its rank among the
    # costed ones is then a bound, and says so; costing every candidate gives the rank.
    exact = json.loads(a.to_json())["pinned"][0]["formula_rank_exact"]
    assert exact == (a.screened[rank - 1].estimate.step <= a.floor_cut)
    assert (f"pinned data8: its best variant ranks {rank} of {len(a.screened)} by formula" in text) == exact
    assert exact or f"pinned data8: its best variant ranks {rank} or lower (candidates not costed" in text
    every = plan(cfg, 8, CPU, top=1, verify=1, remats=("none",), pin=[{"data": 8}], prune=False)
    (_, every_rank, _, _), = every.pinned
    assert every_rank >= rank and (every_rank == rank or not exact)
    assert f"pinned data8: its best variant ranks {every_rank} of {len(every.screened)} by formula" in str(every)
    assert no_rank is None and none is None and "layers per stage" in reasons[0]  # 2 layers over 8 stages
    assert json.loads(a.to_json())["pinned"][0]["planned"]["key"] == r.candidate.key
    with pytest.raises(ValueError, match="multiplying to 8 devices"):
        plan(cfg, 8, CPU, top=1, verify=0, remats=("none",), pin=[{"data": 4}])


def test_the_configs_own_mesh_is_planned_beside_the_best_with_its_ratio():
    """own_mesh (the CLI's default): the config file's mesh section, resolved on the devices, is planned
    whatever its rank and reported with its step over #1's; a section that does not resolve pins nothing."""
    cfg = _config("tiny_moe_lm")
    cfg.mesh.update(dict(data=-1, expert=4))
    assert SP.config_mesh(cfg, 8) == {a: 1 for a in SP.AXES} | {"data": 2, "expert": 4}
    assert SP.config_mesh(cfg, 6) is None and SP.config_mesh(cfg, 4) == {a: 1 for a in SP.AXES} | {"expert": 4}
    a = plan(cfg, 8, CPU, top=1, verify=1, remats=("none",), own_mesh=True)
    assert a.own == {a_: 1 for a_ in SP.AXES} | {"data": 2, "expert": 4}
    (sizes, rank, r, _), = a.pinned
    assert r.candidate.sizes == a.own and r.estimate.source == "partitioner"
    ratio = r.estimate.step / a.ranked[0].estimate.step
    assert ratio >= 1.0 or r is a.ranked[0]
    assert f"the config's own mesh data2.expert4: its best variant ranks {rank}" in str(a)
    assert f"({ratio:.2f}x #1's)" in str(a)
    entry = json.loads(a.to_json())["pinned"][0]
    assert entry["own"] is True and entry["step_ratio_to_best"] == pytest.approx(ratio)
    assert not plan(cfg, 8, CPU, top=1, verify=0, remats=("none",)).pinned  # the API pins only when asked


@pytest.mark.slow  # starts a worker process
def test_a_worker_process_plans_the_same():
    """plan(worker=True), as the CLI calls it: every second candidate planned in a spawned process, the
    same plan."""
    cfg = _config("tiny_moe_lm")
    alone = plan(cfg, 8, CPU, top=3, remats=("none",))
    helped = plan(cfg, 8, CPU, top=3, remats=("none",), worker=True)
    assert len(helped.ranked) == 3 and helped.to_json() == alone.to_json()


def test_gs_plan_is_the_planner():
    import gshard_jax as gs
    assert gs.plan is plan and "plan" in gs.__all__


def test_plan_is_deterministic_and_every_rejection_has_one_reason():
    cfg = _config("tiny_moe_lm")
    a = plan(cfg, 8, CPU, top=1, verify=1, remats=("none",))
    b = plan(cfg, 8, CPU, top=1, verify=1, remats=("none",))
    assert a.to_json() == b.to_json()
    kinds = {"experts", "indivisible", "batch", "layers per stage", "schedule", "context", "over memory", "partitioner"}
    assert a.rejected and all(kind in kinds and reason for _, kind, reason in a.rejected)
    keys = [k for k, _, _ in a.rejected]
    assert len(keys) == len(set(keys))  # one reason each
    # ... and none of them ranked: compare candidates whatever order their axes were given
    kept = {dataclasses.replace(r.candidate, mesh=tuple(sorted(r.candidate.mesh))).key for r in a.screened}
    assert len(kept) == len(a.screened)
    rejected_options = {" ".join(k.split()[1:]) + "@" + ".".join(sorted(k.split()[0].split(".")))
                        for k in keys if " " in k}
    assert not {" ".join(k.split()[1:]) + "@" + ".".join(sorted(k.split()[0].split("."))) for k in kept} \
        & rejected_options
    assert a.ranked[0].estimate.source == "partitioner"
    # The JSON lists whole meshes, over-memory and unplannable candidates, and counts the rest per reason.
    saved = json.loads(a.to_json())
    assert len(saved["rejected"]) + sum(saved["rejected_by_reason"].values()) == len(a.rejected)
    assert all(r["kind"] in ("over memory", "partitioner") or " " not in r["candidate"] for r in saved["rejected"])
    # A memory budget below every candidate's: nothing ranked, every candidate rejected over memory.
    tight = plan(cfg, 8, CPU, memory_gb=1e-6, top=1, verify=1, remats=("none",))
    assert not tight.ranked and tight.rejection_counts()["over memory"] > 0
    with pytest.raises(ValueError, match="no configuration"):
        tight.best


def test_scaling_every_bandwidth_leaves_the_communication_ranking_unchanged():
    hw = hardware.Hardware("t", "gpu", 4, 1e14, 0.5, 80.0, 100e9, 25e9, latency=0.0,
                           table=((1, 1, 2, 2, 76.0), (1, 1, 4, 4, 225.0)))
    cfg = _config("tiny_moe_lm")
    shape = SP.model_shape(cfg)
    screened = plan(cfg, 8, hw, top=0, verify=0).screened

    def ranking(h):  # equal times (up to float rounding in the sums) tie-break by name
        return sorted((float(f"{sum(c.time(h, r.candidate.mesh) for c in E.collectives(shape, r.candidate)):.9e}"),
                       r.candidate.key) for r in screened)
    base = [k for _, k in ranking(hw)]
    assert len(set(base)) > 100
    for factor in (0.1, 3.0):
        assert [k for _, k in ranking(hardware.scaled(hw, factor))] == base


def _sweep(name: str) -> list:
    """One candidate per mesh factorisation of 8 the model accepts, cycling through the training options
    (zero stages, EPSO, microbatches, schedules and repeats)."""
    cfg = _config(name)
    shape = SP.model_shape(cfg)
    out, n = [], 0
    for sizes in SP.factorizations(8, SP.AXES):
        if SP.mesh_reason(shape, sizes):
            continue
        opts = [f for f, r in SP.options(shape, sizes, ("none",)) if r is None]
        if opts:
            out.append(SP.Candidate(SP.orders(sizes)[0], **opts[n % len(opts)]))
            n += 1
    return [(name, c) for c in out]


def _assert_planned_equals_compiled(name: str, c: SP.Candidate) -> None:
    cfg = _config(name)
    report = PR.explain(cfg, c, CPU)  # what the planner costs: the step on an abstract mesh
    run = PR.apply(cfg, c)
    trainer = Trainer(run, "")  # the same step on this host's 8 devices
    state = trainer.in_memory(jax.eval_shape(trainer.init_state, jax.random.key(0)))
    compiled = trainer.step_fn.lower(state, PR.abstract_batch(run)).compile()
    stats, predicted = collective_stats(compiled), report.totals()
    for kind in predicted:
        assert (predicted[kind]["count"], predicted[kind]["payload_bytes"]) == \
            (stats[kind]["count"], stats[kind]["payload_bytes"]), (c.key, kind, predicted, stats)
    host = report.argument_bytes(host=True)["total"]
    assert (host > 0) == c.offload
    # XLA:CPU counts pinned_host arguments (offloaded optimizer state) with the device's: its memory is the host's
    assert report.argument_bytes()["total"] + host == compiled.memory_analysis().argument_size_in_bytes


SWEEP = [pytest.param(n, c, id=f"{n}-{c.key}", marks=pytest.mark.slow)
         for name in ("tiny_dense_lm", "tiny_moe_lm", "tiny_moe_encdec") for n, c in _sweep(name)]
DEFAULT = [pytest.param("tiny_moe_lm", SP.Candidate((("data", 2), ("expert", 4)), zero_stage=1, microbatches=2),
                        id="tiny_moe_lm-data2.expert4-zero1-m2"),
           pytest.param("tiny_dense_lm", SP.Candidate((("stage", 2), ("z", 2), ("x", 2)), zero_stage=1,
                                                       microbatches=4, schedule="1f1b"),
                        id="tiny_dense_lm-stage2.z2.x2-1f1b", marks=pytest.mark.slow),
           pytest.param("tiny_dense_lm", SP.Candidate((("stage", 2), ("context", 2), ("x", 2)), zero_stage=0,
                                                       microbatches=2, schedule="1f1b"),
                        id="tiny_dense_lm-stage2.context2.x2-1f1b", marks=pytest.mark.slow),
           pytest.param("tiny_dense_lm", SP.Candidate((("data", 4), ("y", 2)), zero_stage=1, offload=True),
                        id="tiny_dense_lm-data4.y2-zero1-offload", marks=pytest.mark.slow)]


@pytest.mark.parametrize("name,c", DEFAULT + SWEEP)
def test_planned_collectives_and_argument_bytes_equal_the_compiled_step(name, c):
    _assert_planned_equals_compiled(name, c)


def test_cli_plan_writes_a_plan_that_train_applies(tmp_path, capsys):
    out = tmp_path / "plan.json"
    config = os.path.join(ROOT, "experiments", "tiny_dense_lm.py")
    assert cli.main(["plan", "--config", config, "--devices", "8", "--top", "1", "--verify", "1",
                     "--out", str(out), "--config.train.seq_len=16", "--config.model.vocab_size=512"]) == 0
    printed = capsys.readouterr().out
    saved = json.loads(out.read_text())
    best = saved["ranked"][0]
    assert best["key"] in printed and best["comm_source"] == "partitioner"
    own, = saved["pinned"]  # the file's own mesh section (data -1: all 8 devices) is planned beside #1
    assert own["own"] is True and own["mesh"] == {a: 8 if a == "data" else 1 for a in SP.AXES}
    assert "the config's own mesh data8" in printed
    applied = configs.load(config)
    from gshard_jax.training import overrides
    overrides.apply(applied, cli._plan_overrides(str(out)))
    assert {a: applied.mesh[a] for a in SP.AXES} == {a: best["mesh"].get(a, 1) for a in SP.AXES}
    assert applied.mesh_order == ",".join(best["mesh_order"])
    assert applied.train.zero_stage == best["zero_stage"] and applied.model.remat == best["remat"]


def test_mesh_order_lays_the_axes_out_as_given_and_names_a_bad_order():
    from gshard_jax.training.train import mesh_for
    cfg = _config("tiny_moe_lm")  # mesh {data 2, expert 4}
    assert mesh_for(cfg).axis_names == ("data", "expert")
    cfg.mesh_order = "expert,data"
    assert mesh_for(cfg).axis_names == ("expert", "data")
    cfg.mesh_order = "expert,z"
    with pytest.raises(ValueError, match="mesh_order='expert,z' must list each mesh axis"):
        mesh_for(cfg)


def test_the_docs_axonn_table_is_the_models_ranking():
    """docs/planner.md's side-by-side table: AxoNN's top 5 for GPT-20B on 32 GPUs and GPT-40B on 64."""
    with open(os.path.join(ROOT, "docs", "planner.md")) as f:
        rows = [line for line in f if re.match(r"\| \d+, \d+, \d+, \d+ \|", line)]
    hw = PROFILES["perlmutter-a100"]
    for col, (layers, hidden, gpus, min_tp) in enumerate(((32, 7168, 32, 16), (38, 9216, 64, 32))):
        want = axonn.rank(hw, 256, 2048, layers, hidden, gpus, min_tp, top=5)
        cells = [[c.strip() for c in r.strip().strip("|").split("|")] for r in rows]
        assert [c[2 * col] for c in cells] == [f"{g.gr}, {g.gc}, {g.gd}, {g.gdata}" for g in want]
        assert [c[2 * col + 1] for c in cells] == [f"{g.seconds:.4f}" for g in want]


def test_a_planned_candidate_takes_the_fastest_order_of_its_axes():
    """docs/planner.md: the planned candidates try every order of their axes."""
    cfg = _config("tiny_moe_lm")
    hw = PROFILES["perlmutter-a100"]  # 4 per node: the order of 8 devices' axes matters
    ranked = plan(cfg, 8, hw, top=2, verify=2, remats=("none",)).ranked
    best = [r for r in ranked if len(r.candidate.mesh) > 1][0]
    report = PR.explain(PR.apply(cfg, best.candidate), best.candidate, hw)
    e = best.estimate
    steps = [E.combine(hw, dataclasses.replace(best.candidate, mesh=o), e.compute, best.comms, e.memory,
                       "partitioner", PR.exposed(report, hw, o, e.compute)).step
             for o in SP.orders(best.candidate.sizes)]
    assert len(steps) > 1 and e.step == pytest.approx(min(steps), rel=1e-12)


def test_explain_on_an_abstract_mesh_is_the_compiled_program_of_flax_and_optax_code():
    """A Flax linen MLP trained by optax's adamw with optax's cross-entropy: explain() on an AbstractMesh (as
    the planner uses it) equals explain() on the devices and the compiled HLO, with XLA's bytes and flops."""
    from jax.sharding import AbstractMesh, AxisType

    import gshard_jax as gs
    from helpers import flax_optax_step

    step, args = flax_optax_step(batch=64, features=64, hidden=256, classes=10)
    mesh = gs.make_mesh({"data": 4, "x": 2})
    abstract = gs.explain(step, AbstractMesh((4, 2), ("data", "x"), axis_types=(AxisType.Auto,) * 2), *args)
    assert abstract.totals() == gs.explain(step, mesh, *args).totals()
    ours = gs.partition(step, mesh).lower(*args).compile()
    xla = gs.partition(step, mesh, backend="xla").lower(*args).compile()
    stats, predicted = collective_stats(ours), abstract.totals()
    for kind in predicted:
        assert (predicted[kind]["count"], predicted[kind]["payload_bytes"]) == \
            (stats[kind]["count"], stats[kind]["payload_bytes"]), (kind, predicted, stats)
    assert abstract.argument_bytes()["total"] == ours.memory_analysis().argument_size_in_bytes
    assert sum(v["payload_bytes"] for v in stats.values()) <= \
        sum(v["payload_bytes"] for v in collective_stats(xla).values())
    assert ours.cost_analysis()["flops"] <= xla.cost_analysis()["flops"]


def test_the_json_plan_gives_each_candidates_formula_planned_and_exposed_communication_and_mfu():
    """Per planned candidate: formula_comm_s (the screen's), comm_s (the planned program's), exposed_comm_s (what
    its list schedule leaves unhidden: all of it on a profile without asynchronous collectives) and mfu (the
    model's flops over step time x peak)."""
    cfg = _config("tiny_moe_lm")
    a = plan(cfg, 8, CPU, top=2, verify=2, remats=("none",))
    shape = SP.model_shape(cfg)
    for r, d in zip(a.ranked, json.loads(a.to_json())["ranked"]):
        assert d["formula_comm_s"] > 0 and d["comm_s"] == pytest.approx(r.estimate.comm_total)
        assert d["exposed_comm_s"] == pytest.approx(d["comm_s"])  # cpu-simulation: collectives between ops
        flops = E.model_flops_per_token(shape) * shape.tokens
        assert d["mfu"] == pytest.approx(flops / (d["step_s"] * 8 * CPU.peak_flops))
    gpu = PROFILES["perlmutter-a100"]
    b = plan(cfg, 8, gpu, top=2, verify=2, remats=("none",))
    assert all(0 <= r.estimate.comm_total - r.estimate.overlap <= r.estimate.comm_total for r in b.ranked)
    assert any(r.estimate.overlap > 0 for r in b.ranked)  # what the schedule hides, no fixed fraction


def test_all_fsdp_and_axonns_best_grids_are_planned_and_a_faster_pinned_candidate_ranks():
    """GPT-40B on 64 A100s: however the screen ranks them, z64 and AxoNN's top grids are planned, and no planned
    candidate, pinned ones included, is faster than the pick."""
    cfg = configs.load(os.path.join(ROOT, "experiments", "gpt_40b.py"))
    hw = PROFILES["perlmutter-a100"]
    a = plan(cfg, 64, hw, top=0, verify=1, pin=[{"z": 32, "data": 2}])
    meshes = [r.candidate.sizes for r in a.ranked]
    for grid in axonn.rank(hw, cfg.train.batch_size, cfg.train.seq_len, cfg.model.num_layers, cfg.model.d_model,
                           64, top=3):
        assert {k: v for k, v in grid.mesh().items() if v > 1} in [{k: v for k, v in m.items() if v > 1}
                                                                   for m in meshes]
    assert any(m["z"] == 64 for m in meshes)
    best = a.ranked[0].estimate.step
    assert all(r.estimate.step >= best for r in a.ranked)
    assert all(r is None or r.estimate.step >= best for _, _, r, _ in a.pinned)


def test_the_formula_is_within_1_5x_of_the_planned_communication_on_gpt_40b():
    """The screen's communication against the planned program's, for every candidate planned on GPT-40B over 64
    A100s (`python benchmarks/planner.py --config experiments/gpt_40b.py --devices 64 --hardware
    perlmutter-a100`)."""
    cfg = configs.load(os.path.join(ROOT, "experiments", "gpt_40b.py"))
    a = plan(cfg, 64, PROFILES["perlmutter-a100"], top=0, verify=5)
    assert len(a.ranked) >= 5
    for r in a.ranked:
        assert 1 / 1.5 <= r.formula_comm / r.estimate.comm_total <= 1.5, (r.candidate.key, r.formula_comm,
                                                                          r.estimate.comm_total)


def test_a_budget_nothing_fits_without_offload_plans_offloaded_candidates():
    """Below every candidate's device memory, the planner offloads the optimizer state where that fits: the
    ranked candidates all offload, their planned host bytes are the partitioner's, their device bytes fit, and
    the same candidates kept on the device were rejected over memory. The host transfer is in the step."""
    cfg = _config("tiny_dense_lm")
    shape = SP.model_shape(cfg)
    every = [SP.Candidate(SP.orders(sizes)[0], **f) for sizes in SP.factorizations(8, SP.AXES)
             if not SP.mesh_reason(shape, sizes) for f, reason in SP.options(shape, sizes) if reason is None]
    least = min(E.memory(shape, c)["total"] for c in every)  # the least any candidate needs on the device
    least_off = min(E.memory(shape, dataclasses.replace(c, offload=True))["total"] for c in every)
    assert least_off < least
    budget = (least + least_off) / 2
    tight = plan(cfg, 8, CPU, memory_gb=budget / 2**30, top=2, verify=2)
    assert tight.ranked and all(r.candidate.offload for r in tight.ranked)
    assert all(r.candidate.offload for r in tight.screened)
    best = tight.ranked[0]
    mem = best.estimate.memory
    assert best.estimate.source == "partitioner" and mem["total"] <= budget
    report = PR.explain(cfg, best.candidate, CPU)
    assert mem["host_optimizer"] == report.argument_bytes(host=True)["optimizer"] > 0
    # a step moves the device's slice of gradients and params (float32 here: a third of the state, whose step
    # counts are scalars, not per parameter), as the program does, plus the host update's scalars (the global
    # norm, step counts)
    exchange = mem["host_optimizer"] / 12 * 4
    moved = report.host_transfers()
    assert moved["to_device"] == pytest.approx(exchange, abs=16) and 0 < moved["to_host"] - exchange <= 16
    assert best.estimate.comm["host-transfer[optimizer]"] == pytest.approx(
        2 * exchange / CPU.host_bandwidth + (2 * mem["host_optimizer"] + exchange) / CPU.host_update_bandwidth)
    kept = dataclasses.replace(best.candidate, offload=False)
    assert any(k == kept.key and kind == "over memory" for k, kind, _ in tight.rejected)
    assert "offload" in best.candidate.key and "--config.train.offload_optimizer=True" in best.candidate.overrides()
    no_host = dataclasses.replace(CPU, host_memory_gib=0.0)  # a profile without host memory offloads nothing
    assert not plan(cfg, 8, no_host, memory_gb=budget / 2**30, top=2, verify=0).screened


@pytest.mark.parametrize("attention,dtype,platform,fused", [
    ("auto", "bfloat16", "gpu", True), ("auto", "bfloat16", "cpu", False), ("auto", "float32", "gpu", False),
    ("cudnn", "bfloat16", "cpu", True), ("einsum", "bfloat16", "gpu", False), ("xla", "bfloat16", "gpu", False)])
def test_fused_attention_keeps_no_scores_for_the_backward(attention, dtype, platform, fused):
    """Without remat, the einsum's [heads, S] scores and probabilities are kept per token and layer; cuDNN's
    kernel ("auto" on a GPU with bf16 heads, or asked for) keeps a float32 log-sum-exp per head instead.
    XLA's implementation materialises the scores like the einsum."""
    cfg = _config("tiny_dense_lm")
    cfg.model.attention, cfg.model.dtype = attention, dtype
    shape = SP.model_shape(cfg, platform)
    assert shape.fused_attention is fused
    c = SP.Candidate((("data", 8),), remat="none")
    got = E.memory(shape, c)["activations"]
    einsum = E.memory(dataclasses.replace(shape, fused_attention=False), c)["activations"]
    a = shape.activation_bytes  # the compute dtype's, or 4 on XLA:CPU (memory_model.py)
    tokens_layers = shape.tokens / c.token_shards * shape.layers
    saved = (compilers.of(platform).scores * shape.heads * shape.seq - 4 * shape.heads / a) * a * tokens_layers
    assert einsum - got == (pytest.approx(saved) if fused else 0)
    # in a scanned stack remat recomputes the scores either way (an unrolled one may keep them: memory_model.py)
    dots, scanned = dataclasses.replace(c, remat="dots"), dataclasses.replace(shape, scan=True)
    assert E.memory(scanned, dots)["activations"] == E.memory(dataclasses.replace(scanned, fused_attention=False),
                                                              dots)["activations"]


@pytest.mark.parametrize("scan", [False, True])
def test_a_scanned_stack_stored_split_holds_two_layers_gathered(scan):
    """Under ZeRO-3 (or FSDP's z) a layer's weights are gathered while it runs; a scanned stack also gathers the
    next layer's beside it (partitioner/strategies/prefetch.py; tests/test_prefetch.py measures it): the screen's
    transient memory is two layers' gathered weights there, one otherwise, and none without a split store."""
    cfg = _config("tiny_dense_lm")
    cfg.model.scan = scan
    shape = SP.model_shape(cfg, "cpu")
    assert shape.scan is scan and shape.periods >= 2
    layer = (shape.layer_params + shape.expert_params) / shape.layers * shape.param_bytes
    zero3 = SP.Candidate((("data", 8),), zero_stage=3)
    assert E.memory(shape, zero3)["transient"] == pytest.approx(layer * (2 if scan else 1))
    assert E.memory(shape, SP.Candidate((("data", 8),), zero_stage=1))["transient"] == 0


@pytest.mark.parametrize("name,hw,dropless", [("tiny_dense_lm", "aurora-pvc", False), ("tiny_moe_lm", "h100-8", True),
                                              ("tiny_moe_encdec", "perlmutter-a100", False)])
def test_no_candidate_screens_below_its_meshs_floor(name, hw, dropless):
    """bound.py's floors against the screen: every option of every mesh (both twins, offloaded or not, every
    order of the axes) costs at least its option group's floor, which is at least its mesh's."""
    from gshard_jax.planner import bound
    cfg = _config(name)
    cfg.train.seq_len = 64
    if dropless:
        cfg.model.moe.dispatch = "dropless"
    hw = PROFILES[hw]
    shape = SP.model_shape(cfg, hw.platform)
    costed = 0
    for sizes in SP.factorizations(8, SP.AXES):
        if SP.mesh_reason(shape, sizes):
            continue
        low = bound.floor(shape, sizes, hw)
        for (m, sched, r), reason, variants in SP.option_groups(shape, sizes):
            if reason:
                continue
            group = bound.group_floor(shape, sizes, hw, m, sched, r)
            assert group >= low * (1 - 1e-12)
            for zero, epso, remat in variants:
                c = SP.Candidate(tuple((a, n) for a, n in sizes.items() if n > 1), zero, epso, m, sched, r, remat)
                for twin in (c, dataclasses.replace(c, sequence_parallel=True), dataclasses.replace(c, offload=True)):
                    comms, mem = E.collectives(shape, twin), E.memory(shape, twin)
                    compute = E.compute_time(shape, twin, hw, 8)
                    for order in SP.orders(sizes):
                        step = E.combine(hw, dataclasses.replace(twin, mesh=order), compute, comms, mem).step
                        assert step >= group * (1 - 1e-12), (twin.key, order)  # (rounding of sums in other orders)
                        costed += 1
    assert costed > 10_000


def test_pruning_keeps_the_exhaustive_ranking_and_costs_few_candidates():
    """plan() costs meshes in the order of their floors and stops where a floor passes the step of the last
    configuration it may plan: the screen up to that step, the planned ranking and the pick are the
    exhaustive screen's, from a fraction of its candidates (counted, not timed)."""
    cfg = _config("tiny_moe_lm")
    cfg.train.update(dict(seq_len=64, batch_size=64))
    hw = PROFILES["aurora-pvc"]
    exhaustive = plan(cfg, 32, hw, top=0, verify=0)  # nothing planned: every mesh costed
    assert not exhaustive.pruned and not exhaustive.pruned_groups
    pruned = plan(cfg, 32, hw, top=1, verify=1)
    assert pruned.pruned > 0 and pruned.pruned_groups > 0
    within = [(r.candidate.key, r.estimate.step) for r in exhaustive.screened
              if r.estimate.step <= pruned.floor_cut]
    assert [(r.candidate.key, r.estimate.step) for r in pruned.screened[:len(within)]] == within
    assert len(within) >= 3  # the 3 x verify configurations it may plan are among them
    full = plan(cfg, 32, hw, top=1, verify=1, prune=False)
    assert not full.pruned and [r.to_dict() for r in full.ranked] == [r.to_dict() for r in pruned.ranked]
    assert full.why() == pruned.why() and len(full.screened) == len(exhaustive.screened)
    costed = len(pruned.screened) + pruned.rejection_counts().get("over memory", 0)
    everything = len(exhaustive.screened) + exhaustive.rejection_counts().get("over memory", 0)
    assert costed * 10 < everything, (costed, everything)
    assert f"{pruned.pruned} meshes and {pruned.pruned_groups} option groups not costed" in str(pruned)


def test_the_shared_abstract_state_is_stacked_for_a_candidate_whose_end_stages_own_the_ends():
    """The planner shares one abstract state across candidates, each stage-owned end held once; a 1F1B
    candidate's explain stacks the ends per stage as its trainer does, and plans as with its own state."""
    cfg = _config("tiny_dense_lm")
    c = SP.Candidate((("stage", 4), ("data", 2)), zero_stage=0, microbatches=8, schedule="1f1b")
    shared = PR.abstract_state(cfg, c)
    assert shared["params"]["params"]["unembed"].shape == (cfg.model.d_model, cfg.model.vocab_size)
    given, own = PR.explain(cfg, c, CPU, state=shared), PR.explain(cfg, c, CPU)
    assert [(v.name, v.shape) for v in given.inputs] == [(v.name, v.shape) for v in own.inputs]
    assert any(v.shape == (4, cfg.model.d_model, cfg.model.vocab_size) for v in given.inputs)
    assert sum(cm.moved for cm in PR.comms(given)) == sum(cm.moved for cm in PR.comms(own))


def test_a_pinned_pipelined_mesh_reports_its_fastest_planned_schedule():
    """The formula may misjudge one schedule against another, so a pinned mesh's best variant of each
    schedule is planned too: what it reports is the fastest the partitioner planned, no slower than its best
    variant by formula planned alone."""
    from gshard_jax.planner import search
    cfg = _config("tiny_dense_lm")
    cfg.model.num_layers = 4
    a = plan(cfg, 8, CPU, top=1, verify=1, remats=("none",), pin=[{"stage": 2, "data": 4}])
    (sizes, rank, r, _), = a.pinned
    by_formula = a.screened[rank - 1]
    others = search._best_per_schedule(a.screened, by_formula.candidate.sizes)
    assert others and {o.candidate.schedule for o in others}.isdisjoint({by_formula.candidate.schedule})
    rejected = []
    planned = search._verify(cfg, a.shape, [by_formula], 1, CPU, a.memory_budget, rejected)[0]
    assert len(planned) == 1, rejected
    alone = planned[0]
    assert r.estimate.source == "partitioner" and r.estimate.step <= alone.estimate.step * (1 + 1e-9)


def test_stage_owned_ends_hold_as_many_bytes_a_device_as_replicated_ends():
    """docs/pipeline.md: an owned end leads with [stages] split over `stage`, so each device holds one slice,
    as many bytes as a replicated copy: the 1F1B step's argument bytes are the same either way."""
    c = SP.Candidate((("stage", 4), ("data", 2)), zero_stage=1, microbatches=8, schedule="1f1b")
    held = {}
    for owned in (True, False):
        cfg = _config("tiny_dense_lm")
        cfg.pipeline.owned_ends = owned
        held[owned] = PR.explain(cfg, c, CPU).argument_bytes()
    assert held[True]["total"] == held[False]["total"] > 0, held


def test_a_candidate_without_offload_drops_the_offloaded_updates_options():
    """A config that offloads with the delayed update in host groups, planned on the device: the candidate's
    config and its train overrides turn the delay and the groups off with the offload (the trainer refuses
    either without it); an offloaded candidate keeps them."""
    cfg = configs.load(os.path.join(os.path.dirname(__file__), "..", "experiments", "tiny_dense_lm.py"))
    cfg.train.offload_optimizer, cfg.train.delayed_update, cfg.train.host_update_groups = True, True, 4
    on_device, offloaded = SP.Candidate(mesh=(("data", 8),)), SP.Candidate(mesh=(("data", 8),), offload=True)
    t = PR.apply(cfg, on_device).train
    assert (t.offload_optimizer, t.delayed_update, t.host_update_groups) == (False, False, 1)
    assert {"--config.train.delayed_update=False", "--config.train.host_update_groups=1"} <= set(
        on_device.overrides())
    t = PR.apply(cfg, offloaded).train
    assert (t.offload_optimizer, t.delayed_update, t.host_update_groups) == (True, True, 4)
    assert not any("host_update_groups" in o for o in offloaded.overrides())


@pytest.mark.parametrize("name,platform", [("tiny_moe_lm", "gpu"), ("tiny_moe_lm", "tpu"), ("tiny_dense_lm", "cpu")])
def test_an_option_groups_least_memory_is_under_every_variant(name, platform):
    """The screen rejects an option group uncosted where its least memory is over the budget
    (search._least_memory): so no variant of any group, offloaded or not, may need less than it, and it is
    one variant's."""
    from gshard_jax.planner import search
    cfg = _config(name)
    cfg.model.moe.dispatch = "dropless" if cfg.model.moe.num_experts else cfg.model.moe.get("dispatch", "einsum")
    shape = SP.model_shape(cfg, platform)
    groups = 0
    for sizes in SP.factorizations(8, SP.AXES):
        if SP.mesh_reason(shape, sizes):
            continue
        mesh = SP.orders(sizes)[0]
        for (m, sched, r), reason, variants in SP.option_groups(shape, sizes):
            if reason:
                continue
            every = {(v, o): E.memory(shape, SP.Candidate(mesh, zero_stage=v[0], epso=v[1], microbatches=m,
                                                           schedule=sched, repeats=r, remat=v[2], offload=o))["total"]
                     for v in variants for o in (False, True)}
            for offload in (False, True):
                least = search._least_memory(shape, mesh, m, sched, r, variants, offload)
                mine = [t for (v, o), t in every.items() if o == offload]
                assert least == min(mine), (sizes, m, sched, r, offload)
            groups += 1
    assert groups > 20
