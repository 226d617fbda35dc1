"""The cost model, and the choices it makes: the compile path, FSDP's split, ``strategy="auto"``.

Every plan the search can choose is checked against a plain one-device optax loop
(``px.testing.assert_equivalent``); the choices themselves are checked against the cost
model's own rules (fastest that fits the budget), not against timers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax._src import monitoring as jax_monitoring  # the listener's removal: not public
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import parallax as px
from benchmarks.models import ListedSwitch
from parallax import _cache
from parallax.parallel.candidates import (
    candidates,
    context_candidates,
    expert_candidates,
    from_mesh,
    more_candidates,
    pipeline_candidates,
    split_candidates,
)
from parallax.pricing import cost, timing
from parallax.pricing.choice import rank
from parallax.state import initialize, search, search_budget
from parallax.state.search import priced_candidates, resolve
from parallax.train import planning
from tests import third_party
from tests.models import MLP, TinyLM, batches, classifier_loss, lm_loss
from tests.test_expert_parallel import nano_loss

pytestmark = pytest.mark.core

MARKED = px.per_example_loss(classifier_loss)


@contextlib.contextmanager
def compiled_functions():
    """The names of the functions XLA compiles within the block, in order (JAX's compile events)."""
    names = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            names.append(kwargs.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield names
    finally:
        jax_monitoring.unregister_event_duration_listener(listener)
LONG = 10**9  # steps of a run long enough that every split is worth pricing


@pytest.fixture(scope="module")
def speeds():
    return cost.calibrate(jax.devices())


def test_calibration_is_measured_once_per_machine_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("PARALLAX_CACHE_DIR", str(tmp_path))
    devices = jax.devices()[:2]
    measured = cost.calibrate(devices)
    assert measured.calibration_seconds > 0
    assert measured.seconds_per_flop > 0 and measured.seconds_per_byte > 0
    assert set(measured.collectives) == set(cost.KINDS)
    assert all(latency >= 0 and per_byte > 0 for latency, per_byte in measured.collectives.values())
    cached = json.loads((tmp_path / "device_speeds.json").read_text())
    assert list(cached) == [measured.key] and "|2|" in measured.key  # per device count (and machine, JAX)
    again = cost.calibrate(devices)
    assert again.calibration_seconds == 0 and again.seconds_per_flop == measured.seconds_per_flop
    assert cost.calibrate(devices, refresh=True).calibration_seconds > 0
    (tmp_path / "device_speeds.json").write_text("{ half a file")  # a crash mid-write: measured again
    assert cost.calibrate(devices).calibration_seconds > 0
    # Another process on the machine stores its measurement while this one measures: both then use
    # the first stored, so a plan and the step it describes price alike (parallel test workers, cold).
    first = json.loads((tmp_path / "device_speeds.json").read_text())[measured.key]
    (tmp_path / "device_speeds.json").unlink()
    real = cost._measure

    def measured_while_another_stores(devices):
        speeds = real(devices)
        _cache.store(cost.CACHE_FILE, measured.key, {**first, "seconds_per_flop": 1.25})
        return speeds

    monkeypatch.setattr(cost, "_measure", measured_while_another_stores)
    assert cost.calibrate(devices).seconds_per_flop == 1.25 == cost.calibrate(devices).seconds_per_flop
    assert _cache.store(cost.CACHE_FILE, measured.key, first)["seconds_per_flop"] == 1.25  # the first kept
    assert _cache.store(cost.CACHE_FILE, measured.key, first, replace=True) == first


def test_estimate_reads_flops_bytes_transposes_and_collectives(speeds):
    mesh = Mesh(np.array(jax.devices()), ("d",))
    x = jax.ShapeDtypeStruct((8 * 64, 256), jnp.float32, sharding=NamedSharding(mesh, P("d")))
    small = jax.jit(lambda a: a * 2.0).lower(x).compile()
    matmul = jax.jit(lambda a: a @ a.T[:, :256]).lower(x).compile()
    gathered = jax.jit(lambda a: a * 2.0, out_shardings=NamedSharding(mesh, P())).lower(x).compile()
    cheap, dear, moving = (cost.estimate(c, speeds) for c in (small, matmul, gathered))
    assert dear.flops > cheap.flops and dear.compute > cheap.compute
    assert cheap.moved == 0 and cheap.collectives == 0
    assert moving.moved == sum(s.bytes for s in px.inspect.collective_bytes(gathered.as_text()).values()) > 0
    assert moving.collectives > 0 and moving.seconds > cheap.seconds
    assert moving.peak == px.inspect.peak_bytes(px.inspect.memory_bytes(gathered)) > 0
    # A physical transpose is counted; a transpose into a relabelled layout (a bitcast) is not.
    text = ("%t = f32[64,32]{1,0} transpose(f32[32,64]{1,0} %a), dimensions={1,0}\n"
            "%b = f32[64,32]{0,1} transpose(f32[32,64]{1,0} %a), dimensions={1,0}\n"
            "%c = bf16[64,32]{1,0} copy(bf16[64,32]{0,1} %b)\n")
    assert px.inspect.layout_bytes(text) == 64 * 32 * 4 + 64 * 32 * 2


def _estimate(seconds, peak):
    return cost.Estimate(seconds=seconds, compute=seconds, memory=0.0, collectives=0.0, flops=0.0,
                         bytes_accessed=0.0, transposed=0, moved=0, peak=peak)


def test_the_fastest_that_fits_is_picked():
    estimates = {"a": _estimate(3.0, 10), "b": _estimate(1.0, 100), "c": _estimate(2.0, 20)}
    assert rank(estimates, None, what="x").picked == "b"
    choice = rank(estimates, 50, what="strategy")
    assert (choice.picked, choice.runner_up, choice.over_budget) == ("c", "a", ("b",))
    assert "strategy c: est. 2000.0 ms" in choice.describe() and "over the 50 B budget: b" in choice.describe()
    assert rank(estimates, 5, what="x").picked == "a"  # none fits: the smallest peak
    with pytest.raises(ValueError, match="No candidate"):
        rank({}, None, what="strategy")


def test_a_marked_loss_lets_the_cost_model_pick_the_compile_path():
    data = batches("mlp", 1, batch_size=32)
    strategy = px.combine(px.FSDP(4, min_weight_size=0, split="largest"), px.TensorParallel(2))
    state = px.init_state(MLP(), optax.adam(1e-3), data[0], strategy=strategy, loss_fn=MARKED)
    step = px.make_train_step(MARKED, strategy)
    assert step.mode() == "auto" and "picks jit or shard_map" in step.describe()
    state, _ = step(state, data[0])
    assert step.mode() in ("jit", "shard_map") and set(step.choice.estimates) == {"jit", "shard_map"}
    priced = next(iter(step.choice.estimates))  # fastest estimate first
    assert step.choice.picked == (timing.measured_pick(priced, step.choice.timed) if step.choice.timed else priced)
    assert step.describe().startswith(f"compile path {step.mode()}: est. ") and "runner-up" in step.describe()
    plain = px.make_train_step(classifier_loss, strategy)  # a loss as written: its trace is read at the first call
    assert plain.mode() == "auto" and "read at the first call" in plain.describe()


@pytest.mark.wide("the search under a memory budget (10 s cold)")
def test_a_memory_budget_drops_the_plans_that_do_not_fit():
    data = batches("mlp", 1, batch_size=32)
    with pytest.raises(ValueError, match=r"no candidate fits the memory budget of 1 B per device on 4 devices, with "
                                         r"all state on the devices or offloaded to host memory "
                                         r"\(DataParallel\(data=4\): its state alone is 75.1 KiB.*Raise memory_budget"):
        resolve(MLP(), optax.adam(1e-3), data[0], "auto", loss_fn=MARKED, devices=jax.devices()[:4],
                options=px.StepOptions(memory_budget=1))
    dp = px.init_state(MLP(), optax.adam(1e-3), data[0], strategy=px.DataParallel(4), loss_fn=MARKED,
                       mesh=px.DataParallel(4).make_mesh(jax.devices()[:4]))
    state_bytes = px.inspect.state_bytes_per_device(dp)
    found = resolve(MLP(), optax.adam(1e-3), data[0], "auto", loss_fn=MARKED, devices=jax.devices()[:4],
                    options=px.StepOptions(memory_budget=state_bytes - 1))
    assert "DataParallel(data=4)" in found.skipped and "over the budget" in found.skipped["DataParallel(data=4)"]
    assert not found.strategy.describe(found.mesh).startswith("DataParallel(data=4)")
    with pytest.raises(ValueError, match="memory_budget='lots'"):
        px.StepOptions(memory_budget="lots")


def test_auto_offers_a_pipeline_over_listed_blocks_and_experts_parallel_over_listed_experts():
    """What ``strategy="auto"`` adds for a model beyond the DP/FSDP/TP meshes, read from the model
    alone (traced from shapes): Hugging Face GPT-2's one block class kept in a list, pipelined;
    nano-moe-jax's experts kept in a list, split by expert (its blocks, a list too, pipelined); a
    model with attention whose batch the devices split, the sequence only where nothing fits."""
    gpt2, gpt2_loss, _ = third_party.MODELS["gpt2"]
    text = third_party.batches("text", 1, batch_size=8)[0]
    assert [s.describe() for s in more_candidates(False, gpt2(layers=2), text, gpt2_loss, (), 4)] == [
        s.describe() for s in pipeline_candidates(4)]
    tokens = {"x": np.zeros((8, 17), np.int32)}
    nano = more_candidates(False, third_party.nano_moe(layers=2), tokens, nano_loss, (), 4)
    assert [s.describe() for s in nano] == [*(s.describe() for s in pipeline_candidates(4)), *(
        s.describe() for s in expert_candidates(4, 4, expert=px.ExpertParallel(modules="ExpertFFN")))]
    assert "ExpertParallel(expert=4, modules='ExpertFFN')" in nano[-1].describe()
    one_layer = more_candidates(False, third_party.nano_moe(layers=1), tokens, nano_loss, (), 4)
    assert all(isinstance(s.parts[0], px.ExpertParallel) for s in one_layer)  # its experts are not blocks to pipeline
    assert more_candidates(False, TinyLM(), tokens, lm_loss, (), 4) == []
    assert [s.describe() for s in more_candidates(False, TinyLM(), tokens, lm_loss, (), 4, over_budget=True)] == [
        s.describe() for s in context_candidates(4)]


@pytest.mark.wide("five candidates compiled and timed, two exact runs (15-20 s)")
def test_auto_times_each_layout_familys_best_and_keeps_experts_in_a_list_exact():
    """A Switch-style mixture whose 8 experts are a list: ``"auto"`` times the close calls and the
    best of each other layout family (tensor, expert) where the cost model prices it within 3x of its
    pick, and keeps the measured fastest past the 10 % margin; the expert meshes train exactly
    (AdamW). (benchmarks/auto_experts.py: at this size the cost model priced ExpertParallel(8) up to
    1.3x its pick, and it measured the fastest, 0.62-0.83 of the other families' steps.)"""
    adamw = optax.adamw(3e-3, weight_decay=0.1)
    ep8, ep4 = px.ExpertParallel(8, modules="Expert"), px.combine(px.ExpertParallel(4, modules="Expert"),
                                                                 px.DataParallel(2))
    among = [px.DataParallel(8), px.combine(px.DataParallel(4), px.TensorParallel(2)), px.TensorParallel(8), ep8, ep4]
    tokens = {"x": np.random.default_rng(0).integers(0, 64, (16, 33)).astype(np.int32)}
    # Steps long enough that only close calls and family bests are timed: the two closest (here DP 4 x
    # TP 2 and TP 8, both of the tensor family), and EP 8 and DP 8 by the family rule only.
    found = resolve(ListedSwitch(128, 512), adamw, tokens, "auto", loss_fn=lm_loss, among=among, steps=10**6,
                    options=px.StepOptions(compile="jit", timed_candidates=2))
    choice, families = found.choice, {}
    fitting = [label for label in choice.estimates if label not in choice.over_budget]  # fastest first
    for label in fitting:
        families.setdefault(tuple(part for part in ("ExpertParallel", "TensorParallel") if part in label), label)
    best = choice.estimates[fitting[0]].seconds
    expected = {label for label in families.values() if choice.estimates[label].seconds <= timing.FAMILY_WINDOW * best}
    assert len(families) == 3 and expected <= set(choice.timed), (families, choice.describe())
    assert choice.picked == timing.measured_pick(fitting[0], choice.timed), choice.describe()
    for strategy in (ep8, ep4):
        report = px.testing.assert_equivalent(ListedSwitch(), adamw, lm_loss, batches("lm", 2, batch_size=8), strategy)
        assert "ExpertParallel" in report.strategy


@pytest.mark.wide("a search on 2 devices and a short run (30 s cold)")
def test_auto_splits_the_sequence_where_its_activations_fit_no_other_mesh_and_trains_like_one_device():
    """Two sequences of 256 tokens on 2 devices: with a budget of 3.1 MiB a device, no DP, FSDP or TP
    mesh fits (their compiled peaks: 3.5 MiB and more), nor the gathered context split (3.3); the
    ring method, a device holding one block of keys at a time, does (2.7 MiB), and so do the
    load-balanced splits, gathered and round the ring (2.0 and 2.1 MiB: one tile of scores at a time,
    the half the causal mask hides skipped). Since the softmax runs in one pass over the tiles the two
    measure within about 15 % of each other here (the ring 20.3 against 23.7 ms on a quiet machine, the
    other way round under load), so the timing of the closest settles which: the pick is one of them,
    and no candidate timed beside it ran more than the search's 10 % margin faster."""
    data = [{"x": np.random.default_rng(seed).integers(0, 64, (2, 257)).astype(np.int32)} for seed in range(2)]
    devices, adamw = jax.devices()[:2], optax.adamw(3e-3, weight_decay=0.1)
    found = resolve(TinyLM(), adamw, data[0], "auto", loss_fn=lm_loss, devices=devices,
                    options=px.StepOptions(memory_budget=int(3.1 * 2**20)))
    balanced = {"ContextParallel(context_balanced=2, load_balance=True)":
                px.ContextParallel(2, axis="context_balanced", load_balance=True),
                "ContextParallel(context_ring_balanced=2, method='ring', load_balance=True)":
                px.ContextParallel(2, axis="context_ring_balanced", method="ring", load_balance=True)}
    assert found.strategy.describe(found.mesh) in balanced, found.describe()
    times = found.choice.timed
    assert (found.choice.picked in times
            and min(times.values()) * (1 + timing.MARGIN) >= times[found.choice.picked]), times
    estimates = found.choice.estimates
    over = [label for label, e in estimates.items() if e.peak > 3.1 * 2**20]
    assert any(label.startswith("DataParallel(data=2)") for label in over) and len(over) >= 4, over
    ring = estimates["ContextParallel(context_ring=2, method='ring'), jit"]
    assert ring.peak <= 3.1 * 2**20 and estimates[found.choice.picked].peak < ring.peak
    assert found.strategy == balanced[found.strategy.describe(found.mesh)]
    px.testing.assert_equivalent(TinyLM(), adamw, lm_loss, data, found.strategy, mesh=found.mesh)


@pytest.mark.parametrize("strategy", [  # the core tier: the two 2-axis hybrids of the three kinds' most-used pair
    pytest.param(s, id=s.describe(), marks=[] if s.describe() in (
        "DataParallel(data=2) × FSDP(fsdp=4)", "FSDP(fsdp=4) × TensorParallel(tensor=2)") else
        [pytest.mark.wide("each mesh the search considers; the core tier trains two of them, and every part in "
                          "tests/test_equivalence.py")])
    for s in candidates(8, fsdp=px.FSDP(min_weight_size=0))])
def test_every_plan_the_search_can_choose_trains_like_one_device(strategy):
    """Each mesh ``strategy="auto"`` considers, on both compile paths (SGD on one, Adam on the other)."""
    data = batches("mlp", 3, batch_size=32)
    paths = ["jit", "shard_map"] if strategy.data_axes else ["jit"]
    for path, optimizer in zip(paths, [optax.sgd(0.1), optax.adam(1e-2)]):
        report = px.testing.assert_equivalent(MLP(), optimizer, MARKED, data, strategy, compile=path)
        assert report.mode == path


def test_strategy_auto_builds_what_the_search_picked_and_trains_like_one_device(caplog):
    data = batches("mlp", 3, batch_size=32)
    jit = px.StepOptions(compile="jit")  # the mesh is under test here; the path choice is tested above
    with caplog.at_level("INFO", logger="parallax"):
        found = resolve(MLP(), optax.adam(1e-2), data[0], "auto", loss_fn=MARKED, options=jit)
    assert found.choice.picked.startswith(found.strategy.describe(found.mesh))
    # the 10 meshes, and FSDP over all 8 as google-parallax lays it out (every param's output dim)
    assert len(found.choice.estimates) + len(found.skipped) == len(priced_candidates(candidates(8), "jit")) == 11
    # an FSDP template with split="auto": each FSDP mesh once per split, each on the path it is fast on, and with
    # the default threshold once more: every param's output dim under jit (google-parallax's layout)
    meshes = candidates(8, fsdp=px.FSDP(split="auto"))  # the 10 (every split of FSDP over 8 is among the opened)
    opened = priced_candidates(meshes, "auto")
    with_fsdp = sum(any(isinstance(p, px.FSDP) for p in c.parts) for c in meshes)
    assert len(meshes) == 10 and len(opened) == 10 + 4 * with_fsdp
    assert [(s.parts[0].split, s.parts[0].min_weight_size, path) for s, path, _ in opened[1:6]] == [
        ("largest", 2**18, "jit"), ("output", 2**18, "jit"), ("input", 2**18, "shard_map"), ("input", 2**18, "jit"),
        ("output", 1, "jit")]
    assert (len(priced_candidates(candidates(8, fsdp=px.FSDP(min_weight_size=64, split="auto")), "auto"))
            == 10 + 3 * with_fsdp)
    assert any(found.describe() in record.getMessage() for record in caplog.records)  # one line, logged
    # init_state(strategy="auto") and make_train_step("auto") through px.testing: the same search again
    # (the times of its close calls are cached: the same pick), against a one-device loop. Every plan
    # the search can pick is checked with SGD and Adam above.
    report = px.testing.assert_equivalent(MLP(), optax.adam(1e-2), MARKED, data, "auto", compile="jit")
    assert report.passed and report.strategy == from_mesh(found.mesh).describe()
    # A step built with "auto" reads its strategy from the state's mesh at the first call.
    state = px.init_state(MLP(), optax.adam(1e-2), data[0], strategy=found.strategy, loss_fn=MARKED, mesh=found.mesh)
    step = px.make_train_step(MARKED, "auto", compile="jit")
    assert step.mode() == "auto" and step.strategy is None
    step(state, data[0])
    assert step.strategy.describe() == from_mesh(found.mesh).describe()


@pytest.mark.wide("FSDP's split search (16 s cold)")
def test_fsdp_split_auto_builds_the_split_the_search_picked():
    data = batches("lm", 3, batch_size=16)
    strategy = px.FSDP(min_weight_size=0, split="auto")
    jit = px.StepOptions(compile="jit")  # the splits are under test here; the path choice is tested above
    found = resolve(TinyLM(), optax.adam(1e-2), data[0], strategy, loss_fn=lm_loss, options=jit, steps=LONG)
    assert set(found.choice.estimates) == {"split=largest, jit", "split=output, jit", "split=input, jit"}
    picked = found.strategy.parts[0].split
    assert found.choice.picked == f"split={picked}, jit"
    with pytest.MonkeyPatch.context() as patched:  # init_state builds the state the search planned for its pick
        patched.setattr(initialize, "plan_state", lambda *args, **kwargs: pytest.fail("the pick planned again"))
        state = px.init_state(TinyLM(), optax.adam(1e-2), data[0], strategy=strategy, loss_fn=lm_loss, options=jit,
                              steps=LONG)
    same = px.init_state(TinyLM(), optax.adam(1e-2), data[0], strategy=px.FSDP(min_weight_size=0, split=picked),
                         loss_fn=lm_loss)
    specs = lambda s: jax.tree.leaves(jax.tree.map(lambda x: x.sharding.spec, s.params))
    # The search again builds the same split (its close calls' times are cached), a plan test_fsdp.py
    # checks against a one-device loop with SGD and AdamW on both paths.
    assert specs(state) == specs(same)
    assert [s.parts[0].split for s in split_candidates(strategy)] == ["largest", "output", "input"]


@pytest.mark.wide("FSDP's split search priced on each path (28-30 s cold)")
@pytest.mark.budget(45, "three searches of up to four splits, each compiled: 28-30 s cold")
def test_split_auto_prices_each_split_on_its_path_and_the_trainer_builds_on_it(caplog, monkeypatch, fresh_compiles):
    """``FSDP(split="auto")``: under ``compile="auto"`` each split is priced on the path it is fast on
    (one compile each, not two), and the Trainer trains the pick on that path."""
    data = batches("lm", 2, batch_size=16)
    auto = px.FSDP(min_weight_size=0, split="auto")
    found = resolve(TinyLM(), optax.adam(1e-2), data[0], auto, loss_fn=lm_loss,
                    options=px.StepOptions(timed_candidates=0), steps=LONG)
    assert set(found.choice.estimates) == {"split=largest, jit", "split=output, jit", "split=input, shard_map",
                                           "split=input, jit"}
    assert found.choice.picked == f"split={found.strategy.parts[0].split}, {found.compile}"
    assert found.step_options(px.StepOptions()).compile == found.compile
    assert found.step_options(px.StepOptions(compile="jit")).compile == "jit"  # a path you chose stands
    # A loss over the whole batch (a ratio of batch sums) is exact on jit only: every split is priced there.
    def weighted(model, batch):
        per_example = optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"])
        weight = (batch["y"] > 2).astype(per_example.dtype)
        return (per_example * weight).sum() / weight.sum()

    mlp = batches("mlp", 1, batch_size=16)[0]
    whole = resolve(MLP(), optax.adam(1e-2), mlp, auto, loss_fn=weighted,
                    options=px.StepOptions(timed_candidates=0), steps=LONG)
    assert set(whole.choice.estimates) == {"split=largest, jit", "split=output, jit", "split=input, jit"}
    assert whole.skipped == {"split=input, jit": "the same program as split=input, jit (every array laid out alike, "
                                                 "on the same path)"}  # input's shard_map plan compiled on jit
    # Splits that place every array alike are one program, priced once: nothing over min_weight_size here.
    alike = resolve(TinyLM(), optax.adam(1e-2), data[0], px.FSDP(), loss_fn=lm_loss,
                    options=px.StepOptions(timed_candidates=0), steps=LONG)
    assert set(alike.choice.estimates) == {"split=largest, jit", "split=input, shard_map",
                                           "split=output, every param, jit"}  # that one splits the small ones
    assert set(alike.skipped) == {"split=output, jit", "split=input, jit"}
    assert "2 laid out like another (split=output, jit, split=input, jit)" in alike.describe()
    trainer = px.Trainer(TinyLM(), optax.adam(1e-2), lm_loss, strategy=auto, max_steps=2,
                         batch_size=16, progress=False, shuffle=False)
    # The search's clock reads 1 s more at each look: pricing the first split took longer than
    # 2 estimated steps, whatever this machine's speed, so the rest are not tried.
    monkeypatch.setattr(search, "time", types.SimpleNamespace(perf_counter=itertools.count().__next__))
    with compiled_functions() as compiled:
        trainer.fit({"x": np.concatenate([b["x"] for b in data])})  # 2 steps: the first split priced is kept
    monkeypatch.undo()
    assert compiled.count("jit(train_step)") == 1, compiled  # the search's program trains: not compiled twice
    assert trainer.search.choice.picked == "split=largest, jit" and len(trainer.search.skipped) == 3
    assert all(why.startswith("not tried: the search had spent") for why in trainer.search.skipped.values()), \
        trainer.search.skipped
    assert trainer.config.step.compile == "jit" and trainer.train_step.mode() == "jit"
    with caplog.at_level("INFO", logger="parallax"):  # nothing to compile: the largest dim, said
        state = px.init_state(TinyLM(), optax.adam(1e-2), data[0]["x"], strategy=auto)
    assert "without it each param is split along its largest dim" in caplog.text
    # The run's length unknown (init_state and make_train_step as pieces, no steps=): priced all the same,
    # bounded by search_seconds alone (no fixed split is fast on every model).
    unknown = resolve(TinyLM(), optax.adam(1e-2), data[0], px.FSDP(), loss_fn=lm_loss,
                      options=px.StepOptions(timed_candidates=0))
    assert unknown.choice is not None and set(unknown.choice.estimates) == set(alike.choice.estimates)
    largest = px.init_state(TinyLM(), optax.adam(1e-2), data[0]["x"], strategy=px.FSDP(min_weight_size=0,
                                                                                         split="largest"))
    assert jax.tree.leaves(jax.tree.map(lambda x: x.sharding.spec, state.params)) == jax.tree.leaves(
        jax.tree.map(lambda x: x.sharding.spec, largest.params))


def test_the_closest_estimates_are_the_ones_worth_timing():
    estimates = {"a": _estimate(1.0, 10), "b": _estimate(1.2, 10), "c": _estimate(1.1, 100), "d": _estimate(2.0, 10)}
    choice = rank(estimates, 50, what="strategy")
    assert timing.closest(choice, 3) == ["a", "b"]  # c is over the budget, d is 2x the best estimate
    assert timing.closest(choice, 1) == [] and timing.closest(rank(estimates, 50, what="x"), 0) == []
    assert timing.closest(rank({"a": _estimate(1.0, 10), "d": _estimate(2.0, 10)}, None, what="x"), 3) == []
    short = {"a": _estimate(0.01, 10), "b": _estimate(0.03, 10), "c": _estimate(0.02, 100), "d": _estimate(0.2, 10)}
    # steps so short that timing the candidates costs under 2 s (6 steps each, by the estimates): all timed
    assert timing.closest(rank(short, 50, what="x"), 3) == ["a", "b", "d"]  # 6 * 0.24 s
    longer = {label: _estimate(10 * est.seconds, est.peak) for label, est in short.items()}
    assert timing.closest(rank(longer, 50, what="x"), 3) == []  # 14.4 s: only close calls are worth it
    # Each other layout family's best within 3x of the pick is timed beside the close calls (the
    # first of a family by estimate only), one over the budget or beyond 3x never.
    wide = {"dp": _estimate(1.0, 10), "tp": _estimate(1.1, 10), "dp2": _estimate(1.15, 10), "ep": _estimate(1.3, 10),
            "ep-slow": _estimate(1.35, 10), "cp": _estimate(1.2, 100), "pp": _estimate(3.5, 10),
            "cp-fits": _estimate(2.9, 10)}
    families = {"dp": (), "dp2": (), "tp": ("TensorParallel",), "ep": ("ExpertParallel",),
                "ep-slow": ("ExpertParallel",), "cp": ("ContextParallel",), "cp-fits": ("ContextParallel",),
                "pp": ("PipelineParallel",)}
    choice = rank(wide, 50, what="strategy")
    assert timing.closest(choice, 2) == ["dp", "tp"]
    assert timing.closest(choice, 2, families) == ["dp", "tp", "ep", "cp-fits"]
    assert timing.closest(choice, 3, families) == ["dp", "tp", "dp2", "ep", "cp-fits"]
    assert timing.closest(choice, 1, families) == []  # timed_candidates=1: nothing runs
    alone = rank({"dp": _estimate(1.0, 10), "ep": _estimate(2.0, 10)}, 50, what="strategy")
    assert timing.closest(alone, 3, {"dp": (), "ep": ("ExpertParallel",)}) == ["dp", "ep"]  # no close call, a family


class _Program:
    def __init__(self, text):
        self.text = text

    def as_text(self):
        return self.text


@pytest.mark.parametrize("budget, order", [(None, "abab"), (150, "aabb")])
def test_timing_runs_round_by_round_when_the_states_fit_together_and_caches_the_times(budget, order, tmp_path,
                                                                                        monkeypatch):
    monkeypatch.setenv("PARALLAX_CACHE_DIR", str(tmp_path))
    ran = []

    def step_of(name):
        return lambda state, batch: (ran.append(name) or state + batch, {"loss": state})

    candidates = {name: timing.Timed(step_of(name), _Program(name), lambda: jnp.zeros(4), jnp.ones(4), 50, 100)
                  for name in "ab"}
    times = timing.measure(candidates, budget, "this machine", rounds=1)
    assert "".join(ran) == order and set(times) == {"a", "b"} and min(times.values()) > 0  # one warm-up step each
    assert timing.measure(candidates, budget, "this machine", rounds=1) == times and len(ran) == 4  # from the cache
    changed = {**candidates, "b": dataclasses.replace(candidates["b"], program=_Program("b, compiled otherwise"))}
    timing.measure(changed, budget, "this machine", rounds=1)
    assert len(ran) == 8  # another program is timed again


@pytest.mark.wide("the search's timing of close calls")
def test_a_close_call_between_compile_paths_is_timed_on_a_copy_of_the_state(tmp_path, monkeypatch):
    """Where jit and shard_map are priced alike, the first call runs both a few steps on copies
    of the caller's state and keeps the measured faster: the step it then takes is the one an
    untimed step on that path takes from the same state (the copies ran, not the state)."""
    monkeypatch.setenv("PARALLAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(timing, "WINDOW", float("inf"))  # every estimate is a close call
    data = batches("mlp", 1, batch_size=32)
    strategy = px.DataParallel(8)
    init = lambda: px.init_state(MLP(), optax.adam(1e-3), data[0], strategy=strategy, loss_fn=MARKED)
    step = px.make_train_step(MARKED, strategy)
    state, metrics = step(init(), data[0])
    priced = next(iter(step.choice.estimates))  # the cost model's pick: fastest estimate first
    assert set(step.choice.timed) == {"jit", "shard_map"}
    assert step.choice.picked == timing.measured_pick(priced, step.choice.timed)
    # The measured fastest replaces the priced pick only when faster by more than the margin (10%).
    assert timing.measured_pick("jit", {"jit": 1.0, "shard_map": 0.95}) == "jit"
    assert timing.measured_pick("jit", {"jit": 1.0, "shard_map": 0.85}) == "shard_map"
    assert timing.measured_pick("jit", {"jit": 0.9, "shard_map": 1.0}) == "jit"
    kept = dataclasses.replace(step.choice, picked="jit", timed={"jit": 0.0100, "shard_map": 0.0097})
    assert kept.describe().endswith("shard_map 9.7 ms, jit 10.0 ms (jit kept: the measured difference is within "
                                    "the timing's noise margin)"), kept.describe()
    assert "timed on the devices: " in step.describe() and int(state.step) == 1
    untimed = px.make_train_step(MARKED, strategy, compile=step.choice.picked)
    expected_state, expected = untimed(init(), data[0])
    assert float(metrics["loss"]) == float(expected["loss"])
    jax.tree.map(np.testing.assert_array_equal, (state.params, state.opt_state, state.rng),
                 (expected_state.params, expected_state.opt_state, expected_state.rng))
    again = px.make_train_step(MARKED, strategy)
    again(init(), data[0])
    assert again.choice.timed == step.choice.timed  # cached per machine and programs: nothing ran
    silent = px.make_train_step(MARKED, strategy, timed_candidates=0)
    silent(init(), data[0])
    assert silent.choice.timed == {} and "timed" not in silent.describe()


@pytest.mark.wide("the search's timing of close calls")
def test_strategy_auto_times_its_close_calls_and_keeps_the_measured_fastest(tmp_path, monkeypatch):
    monkeypatch.setenv("PARALLAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(timing, "WINDOW", float("inf"))  # every candidate is a close call
    data = batches("mlp", 1, batch_size=32)
    pool = [px.DataParallel(4), px.TensorParallel(4)]
    search = lambda **options: resolve(MLP(), optax.adam(1e-3), data[0], "auto", loss_fn=MARKED,
                                       devices=jax.devices()[:4], among=pool, options=px.StepOptions(**options))
    found = search()
    assert set(found.timed) == set(found.choice.estimates) and len(found.timed) == 2
    assert found.choice.picked == timing.measured_pick(next(iter(found.choice.estimates)), found.timed)
    assert found.choice.picked.startswith(found.strategy.describe(found.mesh))
    assert "timed on the devices: " in found.describe()
    assert search().timed == found.timed  # cached per machine and program: the same pick, nothing run
    untimed = search(timed_candidates=0)
    assert untimed.timed == {} and untimed.choice.picked == next(iter(untimed.choice.estimates))
    with pytest.raises(ValueError, match="timed_candidates=-1; use an integer >= 0"):
        px.StepOptions(timed_candidates=-1)


@pytest.mark.wide("the search's stopping rule, timed")
def test_the_search_stops_once_it_has_spent_what_it_could_win_or_its_time(tmp_path, monkeypatch):
    """A run of one step cannot win back more than one step: after the first candidate the search
    stops; so it does once ``search_seconds`` are spent. What was not tried is said. Where the clock
    stopped it, the same search on this machine stops there again, however fast its clock runs (a
    run killed and resumed, or run twice, trains on one plan)."""
    monkeypatch.setenv("PARALLAX_CACHE_DIR", str(tmp_path / "first"))
    data = batches("mlp", 1, batch_size=32)
    pool = [px.DataParallel(4), px.FSDP(4, split="largest"), px.TensorParallel(4)]
    search = lambda steps=None, **options: resolve(
        MLP(), optax.adam(1e-3), data[0], "auto", loss_fn=MARKED, devices=jax.devices()[:4], among=pool,
        options=px.StepOptions(timed_candidates=0, **options), steps=steps)
    short = search(steps=1)
    assert len(short.choice.estimates) == 1 and short.strategy == px.DataParallel(4)
    assert all("more than 1 steps of the best so far" in why for why in short.skipped.values()), short.skipped
    assert len(short.skipped) == 2 and "2 not tried (the search had spent" in short.describe()
    hurried = search(search_seconds=1e-9)
    assert len(hurried.choice.estimates) == 1 and "(search_seconds)" in next(iter(hurried.skipped.values()))
    assert len(search(steps=10**9).choice.estimates) == 3  # a long run: every candidate priced
    monkeypatch.setattr(search_budget, "time", types.SimpleNamespace(perf_counter=lambda: 0.0))  # a clock that stands
    again = search(steps=1)
    assert list(again.choice.estimates) == list(short.choice.estimates) and again.strategy == short.strategy
    assert all(why.endswith(search_budget.REPLAYED) for why in again.skipped.values()), again.skipped
    (tmp_path / "another_machine").mkdir()  # the same device speeds, no search stops cached
    (tmp_path / "another_machine" / cost.CACHE_FILE).write_bytes((tmp_path / "first" / cost.CACHE_FILE).read_bytes())
    monkeypatch.setenv("PARALLAX_CACHE_DIR", str(tmp_path / "another_machine"))
    assert len(search(steps=1).choice.estimates) == 3  # nothing cached: this clock would have tried them all
    hours = itertools.count(0, 3600)  # a clock an hour on at every reading: stops after the first, but for the cache
    monkeypatch.setattr(search_budget, "time", types.SimpleNamespace(perf_counter=lambda: float(next(hours))))
    replayed = search(steps=1)
    assert len(replayed.choice.estimates) == 3 and not replayed.skipped, replayed.skipped
    with pytest.raises(ValueError, match="search_seconds=0; use a number of seconds > 0, or None"):
        px.StepOptions(search_seconds=0)


def test_trainer_with_strategy_auto(capsys, monkeypatch):
    data = batches("mlp", 1, batch_size=64)[0]
    trainer = px.Trainer(MLP(), optax.adam(1e-2), MARKED, strategy="auto", max_steps=3, batch_size=32,
                         progress=True, log_every=10)
    assert trainer.mesh is None and trainer.search is None

    def planned_again(*args, **kwargs):
        raise AssertionError("the Trainer planned the search's pick a second time")

    with monkeypatch.context() as patched:  # the state the search planned for its pick is the one built
        patched.setattr(planning, "plan_state", planned_again)
        result = trainer.fit(data)
    assert trainer.search is not None and trainer.strategy is trainer.search.strategy
    assert trainer.plan is trainer.search.plan and trainer.plan.strategy == trainer.strategy
    said = capsys.readouterr().out
    assert trainer.search.headline() in said and len(trainer.search.headline()) < 200, said  # a line a person reads
    chosen = px.Trainer(MLP(), optax.adam(1e-2), MARKED, strategy=trainer.strategy, max_steps=3, batch_size=32,
                        progress=False).fit(data)
    assert [h["loss"] for h in result.history.train] == [h["loss"] for h in chosen.history.train]


def test_auto_needs_a_loss_and_its_own_mesh():
    data = batches("mlp", 1, batch_size=32)
    with pytest.raises(ValueError, match="pass loss_fn="):
        px.init_state(MLP(), optax.adam(1e-3), data[0], strategy="auto")
    with pytest.raises(ValueError, match="picks the mesh shape itself"):
        px.init_state(MLP(), optax.adam(1e-3), data[0], strategy="auto", loss_fn=MARKED,
                      mesh=px.FSDP().make_mesh())
    with pytest.raises(ValueError, match=r"strategy 'fastest': 'fastest' is not dp, fsdp, tp, pp, cp or ep.*'auto'"):
        px.make_train_step(MARKED, "fastest")
    with pytest.raises(ValueError, match=r"FSDP\(split='middle'\).*'auto'"):
        px.FSDP(split="middle")
    odd = Mesh(np.array(jax.devices()), ("batch",))
    with pytest.raises(ValueError, match="include \\['batch'\\]; pass the strategy the state was built with"):
        from_mesh(odd)
