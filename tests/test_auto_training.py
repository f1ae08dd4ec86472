"""mesh.auto: the training runtime with the models' rules table dropped, every sharding but the batch's chosen
by the partitioner (gs.partition(auto=True)), the state kept where the choice put it; and the pieces it rests
on: gs.chosen_shardings, and an output in a donated argument's buffer leaving as that argument arrives."""
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from test_auto import MESH2, close, mlp_args, mlp_step
from test_sharded_state import ROOT, assert_same_run, batches, make, run

import gshard_jax as gs
from gshard_jax.models.logical import AUTO_RULES

AUTO = dict(data=2, expert=4, auto=True)


def test_an_output_in_a_donated_arguments_buffer_leaves_as_that_argument_arrives():
    """The MLP step with its weights donated: each new weight is chosen with its old one (the same sharding),
    its bytes count once in the budget, and the compiled program aliases them."""
    mesh, args = gs.make_mesh(MESH2), mlp_args()
    kw = dict(in_shardings=(P("data", None), None, None), auto=True, donate_argnums=(1, 2))
    report = gs.explain(mlp_step, mesh, *args, **kw)
    ins, outs = [v.boundary for v in report.inputs], [v.boundary for v in report.outputs]
    assert ins[1:] == outs[1:]
    local = [int(np.prod(s.local_shape(a.shape, dict(mesh.shape)))) * 4 for s, a in zip(ins, args)]
    assert f"arguments and outputs {sum(local) / 2**20:.1f}MiB and temporaries" in report.notes[0]  # and the loss
    fn = gs.partition(mlp_step, mesh, **kw)
    m = fn.lower(*args).compile().memory_analysis()
    assert m.alias_size_in_bytes == sum(local[1:])
    assert m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes == pytest.approx(
        sum(local) + 4, abs=64)  # XLA's output tuple adds a few bytes
    close(fn(*args), jax.jit(mlp_step)(*args))


def test_chosen_shardings_are_what_partition_auto_compiles():
    mesh, args = gs.make_mesh(MESH2), mlp_args(256, 256, 1024)
    ins, outs = gs.chosen_shardings(mlp_step, mesh, *args, in_shardings=(P("data", None), None, None))
    assert isinstance(ins, tuple) and len(ins) == 3 and all(isinstance(s, P) for s in ins + tuple(outs))
    assert ins[0] == P("data", None)
    fn = gs.partition(mlp_step, mesh, in_shardings=(P("data", None), None, None), auto=True)
    compiled = fn.lower(*args).compile()
    named = lambda spec: jax.sharding.NamedSharding(mesh, spec)
    assert all(c.is_equivalent_to(named(s), a.ndim) for c, s, a in zip(compiled.input_shardings[0], ins, args))
    shapes = jax.eval_shape(mlp_step, *args)
    assert all(c.is_equivalent_to(named(s), a.ndim) for c, s, a in zip(compiled.output_shardings, outs, shapes))


def test_mesh_auto_trains_as_the_unpartitioned_step_and_keeps_the_state_where_it_chose():
    """A small tiny_moe_lm (its layers scanned) on {data 2, expert 4} with mesh.auto: nothing in the model
    annotates (the rules table is AUTO_RULES), five steps equal the unpartitioned step's, and the state leaves
    each step in the shardings it arrived in, the ones the choice gave it."""
    trainer = make(AUTO, model=dict(scan=True))
    assert trainer.model.cfg.rules == AUTO_RULES and trainer.batch_spec == P(("data", "expert"), None)
    with gs.annotations.active(trainer.mesh, "gshard"):  # as partition traces it
        jaxpr = str(jax.make_jaxpr(trainer.train_step)(jax.eval_shape(trainer.init_state, jax.random.key(0)),
                                                       batches(trainer, 1)[0]))
    assert "sharding_annotation" not in jaxpr  # no annotation from the model, the layout or the step
    rules = make("d2e4")
    with gs.annotations.active(rules.mesh, "gshard"):  # which the rules table makes
        assert "sharding_annotation" in str(jax.make_jaxpr(rules.train_step)(
            jax.eval_shape(rules.init_state, jax.random.key(0)), batches(rules, 1)[0]))
    got = run(trainer)
    assert_same_run(got, run(trainer, partitioned=False), 1e-5)
    specs = jax.tree.leaves(trainer.state_specs, is_leaf=lambda x: isinstance(x, P))
    named = lambda spec: jax.sharding.NamedSharding(trainer.mesh, spec)
    assert all(x.sharding.is_equivalent_to(named(s), x.ndim) for x, s in zip(jax.tree.leaves(got[1]), specs))
    assert trainer.auto_notes[0].startswith("mesh.auto: the state's shardings chosen in")


@pytest.mark.slow  # about 40 s: the choice, and explain's runner-ups
def test_gshard_jax_explain_with_mesh_auto_reports_the_choice(tmp_path, capsys):
    from gshard_jax import cli
    assert cli.main(["explain", "--config", os.path.join(ROOT, "experiments", "tiny_moe_lm.py"), "--workdir",
                     str(tmp_path), "--config.mesh.auto=true", "--config.model.scan=true"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the report's lines unwrapped
    assert "mesh.auto: the state's shardings chosen in" in out and "automatic sharding:" in out
    predicted = float(re.search(r"predicted ([\d.]+) ms of the step", out).group(1)) * 1e3
    comm, compute = (float(x) for x in re.search(r"predicted communication ([\d.e+]+)us \(.*\), compute "
                                                  r"([\d.e+]+)us per step", out).groups())
    assert predicted == pytest.approx(comm + compute, rel=0.02)  # the choice's estimate is the program's


def test_mesh_auto_within_a_memory_budget_shards_the_state_and_fits(monkeypatch):
    """With mesh.memory_budget at the replicated state's bytes (which the replicated step exceeds by its
    temporaries), the choice splits the state, and the compiled step holds its state, batch, outputs and
    temporaries within the budget (memory_analysis(), the donated state counted once). The scanned step's
    graph is over auto_search.EXACT_OPTIONS, so it is searched until the time limit: 30 s here, as whatever
    choice the search returns is within the budget."""
    from gshard_jax.partitioner.auto import choice as auto, search as auto_search
    monkeypatch.setattr(auto, "BUDGETED_SECONDS", 30.0)
    searched = []
    search = auto_search.search
    monkeypatch.setattr(auto_search, "search", lambda *a, **k: searched.append(1) or search(*a, **k))
    rules = make("d2e4", model=dict(scan=True))  # the same state's shapes
    state = jax.eval_shape(rules.init_state, jax.random.key(0))
    whole = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    budget = whole
    trainer = make(dict(AUTO, memory_budget=budget), model=dict(scan=True))
    assert any(any(e is not None for e in s) for s in jax.tree.leaves(trainer.state_specs,
                                                                     is_leaf=lambda x: isinstance(x, P)))
    batch = jax.device_put(batches(trainer, 1)[0], trainer.batch_sharding)
    m = trainer.step_fn.lower(trainer.init_fn(jax.random.key(0)), batch).compile().memory_analysis()
    assert (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
            <= budget)
    assert searched


@pytest.mark.parametrize("option,message", [
    (dict(train=dict(offload_optimizer=True)), "train.offload_optimizer"),
    (dict(model=dict(sequence_parallel=True)), "model.sequence_parallel"),
    (dict(mesh=dict(stage=2, expert=2)), "mesh.stage > 1"),
    (dict(moe=dict(dispatch="dropless")), "model.moe.dispatch='dropless'"),
    (dict(mesh=dict(memory_budget=-1.0)), "mesh.memory_budget=-1.0: expected bytes per device"),
    (dict(mesh=dict(auto=False, memory_budget=1e6)), "mesh.memory_budget=1000000.0 bounds the automatic"),
])
def test_mesh_auto_names_what_needs_a_rules_table(option, message):
    from gshard_jax import configs
    cfg = configs.load(os.path.join(ROOT, "experiments", "tiny_moe_lm.py"))
    cfg.mesh.update(AUTO)
    for section, values in option.items():
        (cfg.model if section == "moe" else cfg)[section].update(values)
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        from gshard_jax.training import train
        train.Trainer(cfg, "/nonexistent")


def test_an_unannotated_model_under_auto_rules_annotates_nothing():
    from gshard_jax.models.logical import automatic, constrain
    mesh = gs.make_mesh(MESH2)
    assert automatic(AUTO_RULES)
    with gs.annotations.active(mesh, "gshard"):
        x = jnp.ones((4, 4))
        assert constrain(x, ("batch", "embed"), AUTO_RULES) is x


def test_the_states_choice_is_the_same_every_time_so_a_checkpoint_restores_onto_it():
    """A resumed run builds its trainer again: the choice (HiGHS on the same program) gives the same state
    shardings, the ones its checkpoint's arrays are placed in."""
    first, again = (make(AUTO, model=dict(scan=True)).state_specs for _ in range(2))
    assert jax.tree.leaves(first, is_leaf=lambda x: isinstance(x, P)) == \
        jax.tree.leaves(again, is_leaf=lambda x: isinstance(x, P))


def test_the_planner_plans_the_rules_tables_configurations_under_mesh_auto():
    from gshard_jax import configs
    from gshard_jax.planner import predict
    from gshard_jax.planner.space import Candidate
    cfg = configs.load(os.path.join(ROOT, "experiments", "tiny_moe_lm.py"))
    cfg.mesh.auto = True
    assert predict.apply(cfg, Candidate((("data", 8),))).mesh.auto is False
