"""``strategies=["auto"]`` on a named hardware compiles as few candidates as its pick needs.

Each candidate's step is bounded before anything compiles: its compute and memory terms, read from
its jaxpr (:func:`parallax.pricing.step_time.lower_bound`), which the compiled step's prediction
only adds to. The candidates compile in the order of their bounds and stop once the next bound is
no less than the runner-up's prediction (:func:`parallax.plan.auto.in_bound_order`). Checked here:
the bound against each compiled step's own terms, and the pick and runner-up against the plan of
every candidate compiled.
"""

from __future__ import annotations

import jax
import optax
import pytest

import parallax as px
from parallax.parallel.names import parse_strategy
from parallax.plan.auto import in_bound_order, pick
from parallax.plan.candidates import evaluate
from parallax.step.options import StepOptions
from tests.models import TinyLM, batches, lm_loss

pytestmark = pytest.mark.core


def _row(name: str, seconds: float, peak: int = 1, moved: int = 0) -> dict:
    return {"strategy": name, "error": None, "peak": peak, "collective_bytes": moved, "step": {"seconds": seconds}}


def test_candidates_compile_in_the_order_of_their_bounds_until_none_left_could_beat_the_runner_up():
    bounds = {"a": 5.0, "b": 1.0, "c": 2.0, "d": 2.5, "e": None, "f": 4.0}
    predicted = {"a": 5.0, "b": 3.0, "c": 2.2, "d": 2.6, "e": 9.0, "f": 4.1}
    compiled = []

    def bounds_for(pool):
        return [{"strategy": s, "error": "does not apply"} if s == "x"
                else {"strategy": s, "error": None, "bound": bounds[s]}
                for s in pool]

    def rows_for(pool):
        compiled.append(list(pool))
        return [_row(s, predicted[s], peak=2 if s == "b" else 1) for s in pool]

    rows = in_bound_order(["a", "b", "c", "d", "x", "e", "f"], rows_for, bounds_for, [], budget=None, width=2)
    # Unbounded first (e: priced from its compiled program), then by bound two at a time; after [b, c] the
    # runner-up is b's 3.0, so d (2.5) compiles; then it is d's 2.6, and f (4.0) and a (5.0) are not compiled.
    assert compiled == [["e", "b"], ["c", "d"]]
    by_name = {row["strategy"]: row for row in rows}
    assert by_name["x"] == {"strategy": "x", "error": "does not apply"}
    assert [name for name, row in by_name.items() if row.get("pruned")] == ["a", "f"]
    assert by_name["f"]["error"] == ("not compiled: its step takes at least 4 s on this hardware (its compute and "
                                     "memory, from its jaxpr), no less than the runner-up's 2.6 s")
    everything = [_row(s, predicted[s], peak=2 if s == "b" else 1) for s in bounds]
    assert (pick(rows, 8, None, "hw").strategy, pick(rows, 8, None, "hw").runner_up) == (
        pick(everything, 8, None, "hw").strategy, pick(everything, 8, None, "hw").runner_up) == ("c", ("d", 2.6))
    assert pick(rows, 8, None, "hw").describe().endswith("(2 of 6 candidates not compiled: their steps' lower bounds "
                                                         "are no less)")
    # A budget: b does not fit, so neither the pick nor its runner-up; rows planned before count too.
    compiled.clear()
    rows = in_bound_order(["a", "b", "c", "d", "f"], rows_for, bounds_for, [_row("z", 2.05)], budget=1, width=1)
    assert compiled == [["b"], ["c"]] and sum(bool(row.get("pruned")) for row in rows) == 3
    # The same program twice (an FSDP that splits nothing beside DP) is not a runner-up: the search goes on.
    compiled.clear()
    predicted.update(c=2.2, d=2.2)
    in_bound_order(["c", "d", "f"], lambda pool: [_row(s, 2.2) for s in pool if compiled.append(s) is None],
                   bounds_for, [], budget=None)
    assert compiled == ["c", "d", "f"]


@pytest.mark.parametrize("strategy", ["dp", "fsdp+tp2"])  # a pipeline's: in the wide test below
def test_a_steps_bound_is_the_compute_and_memory_its_compiled_prediction_reads_from_the_same_jaxpr(strategy):
    """On each path: the bound's memory term is the prediction's (the same jaxpr, the same bytes), its
    compute term the jaxpr's matmuls, which the prediction takes unless the compiled program counts more
    FLOPs (a tiny model's elementwise ones do). With both paths open, the bound is the lesser path's."""
    model, batch = TinyLM(), batches("lm", 1, 16)[0]
    predicted = {}
    for path in ("jit", "shard_map", "auto"):
        args = (model, optax.adamw(1e-3), batch, px.per_example_loss(lm_loss), parse_strategy(strategy),
                jax.devices()[:8], StepOptions.create(precision="bf16", compile=path), 0, None, px.Hardware("h100"))
        bounded, row = evaluate(*args, bound_only=True), evaluate(*args)
        if row.get("error"):  # a path that does not apply (a stage axis compiles with jit only): before compiling
            assert bounded["error"] == row["error"], (bounded, row)
            continue
        assert "compiled" not in bounded and bounded["state"] == row["state"] and bounded["mesh"] == row["mesh"]
        step = row["step"]
        if path == "auto":
            assert bounded["bound"] == pytest.approx(min(predicted.values()), rel=1e-12)
            assert bounded["bound"] <= step["seconds"]
            continue
        predicted[path] = bounded["bound"]
        assert step["memory"] < bounded["bound"] <= step["compute"] + step["memory"] <= step["seconds"]


@pytest.mark.wide("a Llama-shaped stack on 2 named GPUs planned twice: every candidate compiled, and 'auto' (~20 s)")
def test_auto_on_named_hardware_picks_what_compiling_every_candidate_picks_compiling_fewer():
    """A Llama-shaped scanned stack on 2 H100s (as CPU devices stand in for them): ``"auto"`` compiles
    some of its candidates and picks the pick and runner-up of a plan that compiles every one of them
    (the same strategies given by name, nothing pruned), each pruned candidate's bound no less than the
    runner-up's step and no more than its own step had it compiled."""
    from benchmarks.llama import Llama, Shape, batch, loss_fn
    from parallax.parallel.candidates import candidates, pipeline_candidates
    from parallax.parallel.pipeline.part import PipelineParallel

    model = Llama(Shape(layers=4, dim=256, ffn=512, heads=4, kv_heads=2, vocab=512, chunk=256, dtype="float32"))
    example = batch(16, 1024)
    auto = px.plan(model, optax.adamw(1e-3), example, loss_fn=loss_fn, strategies=["auto"], devices=2,
                   hardware="h100", isolate=False)
    pool = [*candidates(2), *pipeline_candidates(2), *pipeline_candidates(2, pipeline=PipelineParallel(remat="layer"))]
    every = px.plan(model, optax.adamw(1e-3), example, loss_fn=loss_fn, strategies=pool, devices=2, hardware="h100",
                    isolate=False)
    assert len(auto.rows) == len(every.rows) == len(pool)
    picked, = auto.picks
    seconds = sorted({row["step"]["seconds"] for row in every.rows if not row.get("error")})
    assert (picked.seconds, picked.runner_up[1]) == (seconds[0], seconds[1]), (picked, seconds[:3])
    pruned = [(mine, theirs) for mine, theirs in zip(auto.rows, every.rows) if mine.get("pruned")]
    assert 0 < len(pruned) < len(pool) and picked.pruned == len(pruned), picked.describe()
    for mine, theirs in pruned:
        assert picked.runner_up[1] <= mine["bound"] <= theirs["step"]["seconds"], (mine, theirs)
