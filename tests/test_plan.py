"""Know before you run: ``px.summarize``, its lint, and ``px.plan`` against what really runs.

Reality is the state ``init_state`` builds (its shards' bytes) and the step that actually
runs compiled on that state and a real batch (its collectives, its compile path): the plan
must equal them exactly, for DP, FSDP, TP and hybrids, on the jit and shard_map paths.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding

import parallax as px
from parallax.inspect import collective_bytes, memory_bytes
from parallax.parallel.names import parse_strategy
from parallax.pricing.timing import closest
from tests.environment import child_env
from tests.models import CNN, MLP, StackedMLP, TinyLM, batches, classifier_loss, lm_loss

pytestmark = pytest.mark.core

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
per_example_lm_loss = px.per_example_loss(lm_loss)
CASES = {  # model, loss, batch kind, strategies
    "mlp": (MLP, classifier_loss, "mlp", ["dp", "fsdp", "tp", "fsdp+tp2"]),
    "cnn": (CNN, classifier_loss, "cnn", ["dp2+fsdp"]),
    "lm": (TinyLM, per_example_lm_loss, "lm", ["dp", "fsdp+tp2"]),  # a per-example loss: the cost model picks
    "stacked": (StackedMLP, classifier_loss, "mlp", ["pp2+fsdp", "dp2+pp4"]),  # a pipeline over its nn.scan stack
}


def small(strategy: str) -> px.Strategy:
    """The strategy with FSDP splitting the test models' small params too."""
    parts = [px.FSDP(p.size, min_weight_size=64, split="largest") if isinstance(p, px.FSDP) else p
             for p in parse_strategy(strategy).parts]
    return parts[0] if len(parts) == 1 else px.combine(*parts)


def cli_model():
    return MLP()


def cli_batch():
    return batches("mlp", 1, 32)[0]


@pytest.fixture(scope="module")
def reports():
    out = {}
    for name, (cls, loss, kind, strategies) in CASES.items():
        # 64KB, which the MLP's FSDP alone fits, only where a test reads it: for the LM nothing fits it, and
        # the search for what would (each option compiled, 16 and 32 devices planned in subprocesses) took 50 s
        # of CPU that nothing read (tests/test_context_parallel.py and test_offload.py check those searches).
        budgets = ["1MB", "64KB"] if name == "mlp" else ["1MB"]
        out[name] = px.plan(cls(), optax.adamw(1e-3), batches(kind, 1, 16)[0], loss_fn=loss,
                            strategies=[small(s) for s in strategies], devices=8, memory_budget=budgets)
    return out


def shard_bytes(tree) -> int:
    device = jax.devices()[0]
    return sum(s.data.nbytes for leaf in jax.tree.leaves(tree) for s in leaf.addressable_shards if s.device == device)


@pytest.mark.parametrize("name", sorted(CASES))
def test_plan_equals_the_built_state_and_the_step_that_runs(reports, name):
    cls, loss, kind, strategies = CASES[name]
    batch = batches(kind, 1, 16)[0]
    for strategy, row in zip(strategies, reports[name].rows):
        assert row["error"] is None, row
        state = px.init_state(cls(), optax.adamw(1e-3), batch, strategy=small(strategy), loss_fn=loss)
        built = {"params": shard_bytes(state.params), "opt_state": shard_bytes(state.opt_state),
                 "model_state": shard_bytes(state.model_state), "total": shard_bytes(state)}
        assert {k: row["state"][k] for k in built} == built, (name, strategy)
        assert row["state"]["gradients"] == built["params"]
        # The plan reports the cost model's pick; where it is a close call (row["timed"]) the first
        # call times the paths and may take the other: the step untimed runs the plan's program.
        step = px.make_train_step(loss, small(strategy), timed_candidates=0)
        mesh = state.step.sharding.mesh
        compiled = step.lower(state, jax.device_put(batch, NamedSharding(mesh, small(strategy).batch_spec()))).compile()
        traffic = collective_bytes(compiled.as_text())
        assert row["compile"] == step.mode()
        assert row["collectives"] == {k: {"count": s.count, "bytes": s.bytes} for k, s in traffic.items()}
        assert row["compiled"] == memory_bytes(compiled)
        assert row["strategy"] == small(strategy).describe(mesh)
        # A data axis and a mean of per-example terms (marked, or read from the trace; the CNN's
        # BatchNorm statistics are summed over the data shards on the shard_map path): two paths.
        if "pp" in strategy:  # a pipeline compiles on jit alone, and moves activations between stages
            assert step.modes() == ("jit",) and row["collectives"]["collective-permute"]["count"] > 0
        elif strategy != "tp":
            assert set(step.choice.estimates) == {"jit", "shard_map"}, (name, strategy)
            timed = closest(step.choice, px.StepOptions().timed_candidates)
            assert row["timed"] == timed
            close_call = f"{' and '.join(timed)} are priced within the cost model's error"
            assert bool(timed) == (close_call in str(row["note"]))


def test_fsdp_plans_less_state_per_device_and_the_budgets_say_what_fits(reports):
    dp, fsdp = reports["mlp"].rows[:2]
    kernels, biases = 24 * 64 + 64 * 64 + 64 * 10, 64 + 64 + 10  # biases of <= 64 elements stay whole
    assert dp["state"]["params"] == 4 * (kernels + biases) and fsdp["state"]["params"] == 4 * (kernels // 8 + biases)
    assert [reports["mlp"].fits(row, 0) for row in reports["mlp"].rows] == [True] * 4
    assert reports["mlp"].fits(fsdp, 1) != reports["mlp"].fits(dp, 1)  # 64KB: the plan tells them apart
    text = str(reports["mlp"])
    assert re.search(r"^8 +FSDP\(fsdp=8\) +(jit|shard_map) +", text, re.M) and "fits 64KB" in text
    assert "note: Per device." in text


@pytest.mark.wide("the advice's search over device counts (12 s cold)")
def test_advice_for_each_device_count_nothing_fits_on():
    report = px.plan(MLP(), optax.adamw(1e-3), batches("mlp", 1, 16)[0], loss_fn=classifier_loss,
                     strategies=[px.DataParallel()], devices=[4, 8], memory_budget="8KB", compile="jit")
    assert set(report.fixes) == {"8KB on 4 devices", "8KB on 8 devices"}, report.fixes
    assert next(fix.row["devices"] for fix in report.fixes["8KB on 4 devices"]) == 4  # then more devices, if need be
    assert "Nothing fits 8KB on 4 devices; for DataParallel(data=4)" in str(report)


def test_an_option_whose_planning_subprocess_dies_is_reported_and_the_search_goes_on():
    """Planning an option may kill its subprocess (a 70B list's 2x devices ran out of this machine's
    memory): that option is reported as not planned, the next ones are still tried, and nothing
    raises (before, the whole plan, its planned rows too, was lost to the RuntimeError)."""
    from parallax.plan.fixes import find_fix

    def evaluate(options, devices, strategy=None):
        if options.offload == "optimizer":
            raise RuntimeError("Planning on 16 h100 GPUs failed in its subprocess: it ran out of this machine's memory")
        return {"strategy": f"FSDP(fsdp={devices})", "peak": 10 if options.offload else 100, "compiled": {}}

    tried = find_fix(evaluate, px.StepOptions(), 8, 50, ())
    assert [fix.change for fix in tried] == ["offload='optimizer'", "offload='optimizer+params'"], tried
    assert tried[0].row["error"].startswith("not planned here: Planning on 16 h100 GPUs") and not tried[0].fits
    assert tried[-1].fits


def test_a_plan_in_a_subprocess_equals_a_plan_in_this_process(reports):
    here = reports["mlp"]
    there = px.plan(MLP(), optax.adamw(1e-3), batches("mlp", 1, 16)[0], loss_fn=classifier_loss,
                    strategies=[small(s) for s in CASES["mlp"][3]], devices=8, memory_budget=["1MB", "64KB"],
                    isolate=True)
    assert there.rows == here.rows


@pytest.mark.wide("a search and two plans of 5 meshes, priced here and on a named GPU (25 s cold)")
def test_plan_auto_picks_what_the_trainers_search_picks_and_on_named_hardware_the_fastest_that_fits():
    """``px.plan(strategies=["auto"])`` plans the meshes ``strategy="auto"`` prices (a stack of blocks:
    its pipelines too) and picks as the search does: on this backend the same pick as ``resolve``
    (the Trainer's search, nothing timed); on a named GPU the fastest predicted step that fits."""
    from parallax.parallel.candidates import candidates, pipeline_candidates
    from parallax.state.search import resolve

    model, batch = StackedMLP(), batches("mlp", 1, batch_size=32)[0]
    here = px.plan(model, optax.adamw(1e-3), batch, loss_fn=classifier_loss, strategies=["auto"], devices=2,
                   isolate=False)
    rows = [row for row in here.rows if row.get("auto")]
    assert len(rows) == len(here.rows) == len(candidates(2)) + len(pipeline_candidates(2))
    found = resolve(model, optax.adamw(1e-3), batch, "auto", loss_fn=classifier_loss, devices=jax.devices()[:2],
                    options=px.StepOptions(timed_candidates=0))
    picked, = here.picks
    assert found.choice.picked.startswith(picked.strategy), (found.describe(), picked)
    assert str(here).splitlines()[-2].startswith(f"auto on 2 devices: {picked.strategy}, est. ")
    # On an H100 with a budget the smallest peaks fit: the fastest predicted of those, the runner-up its next.
    peaks = sorted(row["peak"] for row in rows if not row.get("error"))
    budget = peaks[len(peaks) // 2]
    gpu = px.plan(model, optax.adamw(1e-3), batch, loss_fn=classifier_loss, strategies=["auto"], devices=2,
                  hardware="h100", memory_budget=budget, isolate=False)
    fitting = sorted((row for row in gpu.rows if gpu.fits(row, 0)), key=lambda row: row["step"]["seconds"])
    picked, = gpu.picks
    assert picked.strategy == fitting[0]["strategy"] and picked.basis == "predicted" and picked.fitting == len(fitting)
    assert all(row["peak"] > budget for row in gpu.rows if not row.get("error") and row not in fitting)
    assert picked.runner_up is None or picked.runner_up[1] >= picked.seconds
    # A budget no state fits: every candidate pruned before compiling (the search's rule), and said so.
    none = px.plan(model, optax.adamw(1e-3), batch, loss_fn=classifier_loss, strategies=["auto"], devices=2,
                   memory_budget=1, isolate=False)
    assert none.picks[0].describe() == (f"auto on 2 devices: none of the {len(rows)} candidates that apply fits "
                                        "the memory budget")
    assert all(re.fullmatch(r"its state alone is [\d.]+ KiB per device, over the budget of 1 B", row["error"])
               for row in none.rows), none.rows


def test_plan_auto_prices_the_candidates_that_compile_one_way_and_picks_as_the_search_does():
    """One long sequence on 2 devices: the batch splits over nothing, so ``"auto"`` prices the tensor
    and context meshes (load-balanced too), each compiled on one path (``jit``) without a choice of
    paths. Every row carries the cost model's estimate and the pick is the search's, where before
    no row had one and the plan said that none fitted a budget it was not given."""
    from parallax.state.search import resolve

    batch = {"x": np.random.default_rng(0).integers(0, 64, (1, 65)).astype(np.int32)}
    plan = px.plan(TinyLM(), optax.adamw(1e-3), batch, loss_fn=lm_loss, strategies=["auto"], devices=2,
                   isolate=False)
    priced = {row["strategy"]: row["estimate"] for row in plan.rows if not row.get("error")}
    assert set(priced) == {"TensorParallel(tensor=2)", "ContextParallel(context=2)",
                           "ContextParallel(context_ring=2, method='ring')",
                           "ContextParallel(context_balanced=2, load_balance=True)",
                           "ContextParallel(context_ring_balanced=2, method='ring', load_balance=True)"}, priced
    assert all(estimate > 0 for estimate in priced.values()), priced  # the cost model's, nothing timed
    found = resolve(TinyLM(), optax.adamw(1e-3), batch, "auto", loss_fn=lm_loss, devices=jax.devices()[:2],
                    options=px.StepOptions(timed_candidates=0))
    picked, = plan.picks
    assert picked.strategy == min(priced, key=priced.get) and found.choice.picked.startswith(picked.strategy), \
        (found.describe(), picked)


@pytest.mark.wide("the CLI in processes of its own (22 s cold)")
def test_the_cli_plans_more_devices_than_it_has_and_prints_a_table():
    env = child_env()
    proc = subprocess.run([sys.executable, "-m", "parallax.plan", "tests.test_plan:cli_model", "--batch",
                           "tests.test_plan:cli_batch", "--loss", "tests.models:classifier_loss", "--strategies",
                           "dp,fsdp,tp3", "--devices", "8,16", "--budget", "200KB", "--target", "gpu"],
                          cwd=ROOT, env=dict(env, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    print(proc.stdout)
    assert lines[0].split()[:4] == ["devices", "strategy", "compile", "params"] and "fits 200KB" in lines[0]
    assert [line.split()[:2] for line in lines[1:5]] == [
        ["8", "DataParallel(data=8)"], ["8", "FSDP(fsdp=8)"], ["16", "DataParallel(data=16)"], ["16", "FSDP(fsdp=16)"]]
    assert re.search(r"TensorParallel\(tensor=3\): does not apply: .*3", proc.stdout)
    assert "compiled for cpu; on gpu they are backend-dependent" in proc.stdout
    assert "note: Budgets in the table's units: 200KB = 195.3 KiB." in proc.stdout  # decimal in, binary out
    # The default min_weight_size keeps this MLP whole: the FSDP rows equal DP's, and say why.
    for devices in (8, 16):
        assert f"  {devices} devices: FSDP(fsdp={devices}) splits only 0.0% of the train state over 'fsdp': every " \
               "param has at most min_weight_size=262,144 elements (the largest has 4,096); lower it" in proc.stdout


def test_the_cli_takes_fsdp_options(capsys):
    from parallax.plan.__main__ import main

    args = ["tests.test_plan:cli_model", "--batch", "tests.test_plan:cli_batch",
            "--loss", "tests.models:classifier_loss", "--devices", "8", "--optimizer", "sgd"]
    assert main([*args, "--strategies", "dp,dp2+fsdp", "--min-weight-size", "64", "--split", "output", "--json"]) == 0
    dp, hybrid = json.loads(capsys.readouterr().out)["rows"]
    # no note but the close call's, where the compile paths are timed at the first call
    assert (hybrid["note"] is None) == (not hybrid["timed"]) and "splits only" not in str(hybrid["note"]), hybrid
    assert hybrid["state"]["params"] < dp["state"]["params"] / 3, (dp, hybrid)
    assert main([*args, "--strategies", "dp,tp", "--min-weight-size", "64"]) == 2
    assert "--min-weight-size is an FSDP option, and none of the strategies 'dp,tp' has an FSDP part" in \
        capsys.readouterr().err
    assert main([*args, "--strategies", "fsdp", "--min-weight-size", "-1"]) == 2
    assert "FSDP(min_weight_size=-1): use an integer >= 0" in capsys.readouterr().err


def test_the_cli_says_what_is_wrong_with_a_reference():
    proc = subprocess.run([sys.executable, "-m", "parallax.plan", "tests.nowhere:model", "--batch", "x:y", "--loss",
                           "x:y", "--devices", "1"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 2 and "cannot import 'tests.nowhere'" in proc.stderr, proc.stderr[-2000:]


def test_bad_arguments_are_clear_errors_before_anything_compiles():
    batch = batches("mlp", 1, 16)[0]
    with pytest.raises(ValueError, match=r"'fsdp\+xp2': 'xp2' is not dp, fsdp, tp, pp, cp or ep"):
        px.plan(MLP(), optax.adamw(1e-3), batch, loss_fn=classifier_loss, strategies=["fsdp+xp2"])
    with pytest.raises(ValueError, match=r"memory_budget='16 gigs'.*'16GB' or '80GiB'"):
        px.plan(MLP(), optax.adamw(1e-3), batch, loss_fn=classifier_loss, memory_budget="16 gigs")
    with pytest.raises(ValueError, match=r"devices=0"):
        px.plan(MLP(), optax.adamw(1e-3), batch, loss_fn=classifier_loss, devices=0)
    with pytest.raises(ValueError, match=r"devices=16 but this process has 8; let it plan in a subprocess"):
        px.plan(MLP(), optax.adamw(1e-3), batch, loss_fn=classifier_loss, devices=[8, 16], isolate=False)


# --- summarize and its lint ---------------------------------------------------------------


def test_summarize_matches_the_built_state_for_every_strategy():
    batch = batches("cnn", 1, 16)[0]
    for strategy in ("fsdp", "dp2+fsdp", "fsdp+tp2"):
        plan = px.plan_state(CNN(), optax.adamw(1e-3), batch, strategy=small(strategy), loss_fn=classifier_loss)
        summary, state = px.summarize(plan), plan.build()
        assert summary.totals["total"]["per_device"] == shard_bytes(state), strategy
        assert summary.totals["model_state"]["per_device"] == shard_bytes(state.model_state)
        assert px.summarize(state, small(strategy)).as_dict() == summary.as_dict()
        n_params = sum(x.size for x in jax.tree.leaves(state.params))
        assert summary.totals["params"]["count"] == n_params  # global, not per shard


def test_the_lint_finds_a_large_replicated_param_and_says_why():
    import flax.linen as nn

    class Wide(nn.Module):  # a (24, 1000) kernel: no dim divisible by 16, so FSDP(16) cannot split it
        @nn.compact
        def __call__(self, x):
            return nn.Dense(10)(nn.Dense(1000, name="wide")(x)).mean(-1)

    def loss(model, batch):
        return (model(batch["x"]) ** 2).mean()

    batch = batches("mlp", 1, 16)[0]
    plan = px.plan_state(Wide(), optax.sgd(0.1), batch, strategy=px.combine(px.DataParallel(1),
                         px.FSDP(8, min_weight_size=0)), loss_fn=loss)
    assert px.summarize(plan, large_bytes=10_000).lint.replicated == ()  # (24, 1000): 1000 splits over 8
    plan = px.plan_state(Wide(), optax.sgd(0.1), batch, strategy=px.FSDP(8, min_weight_size=50_000), loss_fn=loss)
    summary = px.summarize(plan, large_bytes=50_000)  # Dense_0/kernel (1000, 10), 40 kB, is below that
    (found,) = summary.lint.replicated
    assert (found.path == "wide/kernel" and found.bytes == 96_000
            and "at most FSDP min_weight_size=50000" in found.reason)
    assert "1 param(s) over 48.8 KiB replicated" in str(summary) and summary.lint.sharded_fraction == 0.0
    with pytest.raises(px.ReplicatedParamError, match=r"(?s)wide/kernel \(24, 1000\) 93.8 KiB: 24000 elements, at most "
                                                      r"FSDP min_weight_size=50000 .*raise fail_if_replicated_over"):
        px.summarize(plan, fail_if_replicated_over=50_000)
    trainer = px.Trainer(Wide(), optax.sgd(0.1), loss, strategy=px.FSDP(8, min_weight_size=50_000),
                         fail_if_replicated_over=50_000, batch_size=16, max_steps=1, progress=False)
    with pytest.raises(px.ReplicatedParamError, match="wide/kernel"):
        trainer.fit(batch)
    assert trainer.state is None  # nothing was built


def test_default_rules_that_match_nothing_are_listed_and_the_trainer_prints_the_summary(capsys):
    batch = batches("mlp", 1, 16)[0]
    tp = px.TensorParallel(2, derive=False)
    plan = px.plan_state(MLP(), optax.sgd(0.1), batch, strategy=tp, loss_fn=classifier_loss,
                         mesh=tp.make_mesh(jax.devices()[:2]))
    unmatched = px.summarize(plan).lint.unmatched_rules
    assert unmatched and set(unmatched) <= {pattern for pattern, _ in px.DEFAULT_RULES}
    assert px.summarize(plan).lint.frozen == () and "frozen" not in str(px.summarize(plan))  # SGD trains every param
    # The first layer frozen the optax way: marked in the table and the lint, never changed by training.
    frozen_up = optax.multi_transform({"train": optax.adam(1e-3), "freeze": optax.set_to_zero()},
                                      lambda params: {name: "freeze" if name == "up" else "train" for name in params})
    trainer = px.Trainer(MLP(), frozen_up, classifier_loss, strategy=small("fsdp"), summary=True,
                         batch_size=16, max_steps=1, progress=False)
    trainer.fit(batch)
    printed = capsys.readouterr().out
    assert "FSDP(fsdp=8) on mesh {'fsdp': 8}" in printed and re.search(r"params +\d", printed)
    assert re.search(r"up/kernel \(frozen\) +\(24, 64\)", printed) and "hidden/kernel (frozen)" not in printed, printed
    assert ("frozen: 2 param(s) the optimizer never changes (no gradient reaches their update): up/bias, up/kernel"
            in printed), printed
    start = px.init_state(MLP(), frozen_up, batch, strategy=small("fsdp"), loss_fn=classifier_loss)
    assert np.array_equal(trainer.state.params["up"]["kernel"], start.params["up"]["kernel"])
    assert not np.array_equal(trainer.state.params["down"]["kernel"], start.params["down"]["kernel"])
    out = io.StringIO()
    px.summarize(trainer.plan).print(file=out)  # not a terminal: plain text
    assert out.getvalue().strip() == str(px.summarize(trainer.plan)).strip()
    json.dumps(px.summarize(trainer.plan).as_dict())


# --- collectives, whatever form the HLO gives its replica groups ----------------------------


def test_collective_bytes_read_the_list_and_the_iota_forms_alike():
    step = px.make_train_step(px.per_example_loss(classifier_loss), px.FSDP(min_weight_size=64), compile="shard_map")
    batch = batches("mlp", 1, 16)[0]
    state = px.init_state(MLP(), optax.sgd(0.1), batch, strategy=px.FSDP(min_weight_size=64, split="largest"),
                          loss_fn=classifier_loss)
    text = step.lower(state, jax.device_put(batch, NamedSharding(state.step.sharding.mesh,
                                                                  px.FSDP().batch_spec()))).compile().as_text()
    lines = [line for line in text.splitlines()
             if re.search(r"(reduce-scatter|all-gather|all-reduce)(-start)?\(", line)]
    assert any("reduce-scatter" in line for line in lines)

    def as_list(line):
        return re.sub(r"replica_groups=(\[\d+,\d+\]<=\[\d+\]|mesh\[[^\]]*\]\s*\{[^}]*\})",
                      "replica_groups={{0,1,2,3,4,5,6,7}}", line)

    def as_iota(line):
        return re.sub(r"replica_groups=(\{\{[0-9,]*\}\}|mesh\[[^\]]*\]\s*\{[^}]*\})", "replica_groups=[1,8]<=[8]", line)

    original = collective_bytes("\n".join(lines))
    assert (collective_bytes("\n".join(map(as_list, lines))) == original
            == collective_bytes("\n".join(map(as_iota, lines))))
    assert original["reduce-scatter"].bytes == 8 * sum(
        int(np.prod([int(d) for d in dims.split(",") if d])) * 4
        for line in lines if "reduce-scatter" in line
        for dims in re.findall(r"f32\[([0-9,]*)\]", line.split("reduce-scatter")[0]))


def test_the_async_start_forms_count_what_their_synchronous_forms_do():
    """GPU HLO writes collectives as ``-start``/``-done`` pairs whose tuple results hold the operands too."""
    forms = {
        "all-gather": ("x = f32[128]{0} all-gather(f32[16]{0} p), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}",
                       "x = (f32[16]{0}, f32[128]{0}) all-gather-start(f32[16]{0} p), replica_groups=[1,8]<=[8], "
                       "dimensions={0}"),
        "reduce-scatter": ("x = f32[16]{0} reduce-scatter(f32[128]{0} p), replica_groups={{0,1,2,3,4,5,6,7}}",
                           "x = f32[16]{0} reduce-scatter(f32[128]{0} p), replica_groups=[1,8]<=[8], dimensions={0}"),
        "all-reduce": ("x = f32[64]{0} all-reduce(f32[64]{0} p), replica_groups={{0,1,2,3},{4,5,6,7}}",
                       "x = f32[64]{0} all-reduce-start(f32[64]{0} p), replica_groups=[2,4]<=[8]"),
        "collective-permute": ("x = f32[8]{0} collective-permute(f32[8]{0} p), source_target_pairs={{0,1},{1,0}}",
                               "x = (f32[8]{0}, f32[8]{0}, u32[], u32[]) collective-permute-start(f32[8]{0} p), "
                               "source_target_pairs={{0,1},{1,0}}"),
    }
    expected = {"all-gather": 512, "reduce-scatter": 512, "all-reduce": 256, "collective-permute": 32}
    for kind, (sync, started) in forms.items():
        assert collective_bytes(sync)[kind].bytes == collective_bytes(started)[kind].bytes == expected[kind], kind


class ParamsCopied:
    """An optimizer whose state starts from the params' values (as EMA or lookahead ones do)."""

    def __new__(cls):
        return optax.GradientTransformation(lambda params: jax.tree.map(lambda p: p * 1.0, params),
                                            lambda updates, state, params=None: (updates, state))


@pytest.mark.parametrize("optimizer", ["adamw", "params-copied"])
def test_a_state_from_given_params_is_the_programs_bit_for_bit_and_compiles_nothing_it_need_not(
        optimizer, monkeypatch, caplog):
    """Given params and an optimizer whose state starts as constants, the state is put together shard by
    shard, no program compiled (nor the params held twice on the devices); an optimizer state made from
    the params still compiles the state's program. Either way: what the program computes, bit for bit,
    and the caller's arrays outlive a step that donates the state."""
    import parallax.state.plan as plan_module

    tx = optax.adamw(1e-3) if optimizer == "adamw" else ParamsCopied()
    batch, strategy = batches("mlp", 1)[0], small("dp2+fsdp")
    given = px.init_state(MLP(), tx, batch, strategy=strategy, loss_fn=classifier_loss).params  # on their shards
    plan = px.plan_state(MLP(), tx, batch, strategy=strategy, loss_fn=classifier_loss, params=given)
    with jax.log_compiles(), caplog.at_level(logging.WARNING):
        built = plan.build()
    compiled = re.search(r"Compiling (jit\()?build_values", caplog.text) is not None
    assert compiled == (optimizer != "adamw"), caplog.text[-2000:]
    monkeypatch.setattr(plan_module, "build_directly", lambda *args, **kwargs: None)
    program = plan.build()
    assert jax.tree.structure(built) == jax.tree.structure(program)
    for a, b in zip(jax.tree.leaves(built), jax.tree.leaves(program), strict=True):
        assert (a.sharding, a.dtype, a.shape, a.weak_type) == (b.sharding, b.dtype, b.shape, b.weak_type)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    px.make_train_step(classifier_loss, strategy)(built, batch)  # donates its state
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(given))
