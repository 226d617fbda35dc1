"""The tensor-parallel layout derived from the computation against hand-written name rules.

    python -m benchmarks.tp_layout                   # 8 simulated CPU devices, all three models
    python -m benchmarks.tp_layout --models mlp --rounds 5
    python -m benchmarks.tp_layout --smoke           # tiny models, one round: checks it still runs

For each benchmark model and each of ``tp`` (8-way) and ``fsdp+tp`` (4×2), two train steps
are compiled: ``TensorParallel()`` (layout derived from the traced loss) and
``TensorParallel(rules=..., derive=False)`` with the rules a person would write (the
Megatron name rules for the MLP and the LM, the two convolutions named for the CNN). Both
are timed in one process, interleaved in a new random order each round; the table gives the
derived step time over the hand-written one, round by round (median, min–max), and the
per-device state and collective bytes of each (exact, from the arrays and the compiled HLO).
Results go to ``benchmarks/results/tp_layout.{json,md}``.
"""

from __future__ import annotations

import argparse
import os
import sys

from benchmarks import report, side_runner_args, time_interleaved

ARGS = side_runner_args(__doc__, models="mlp,lm,cnn", strategies="tp,fsdp+tp") \
    if __name__ == "__main__" else None

import jax  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import parallax as px  # noqa: E402
from benchmarks.models import build, make_batch  # noqa: E402
from benchmarks.run import BATCH, MB, MIN_WEIGHT_SIZE, Config, round_ratios  # noqa: E402
from parallax.inspect import state_bytes_per_device  # noqa: E402


def strategies(name: str, rules) -> tuple[px.Strategy, px.Strategy]:
    """``(derived, hand-written)`` versions of one strategy (``rules=None``: the default name rules)."""

    def make(tp):
        if name == "tp":
            return tp(-1)
        return px.combine(px.FSDP(-1, min_weight_size=MIN_WEIGHT_SIZE), tp(2))

    derived = make(lambda size: px.TensorParallel(size))
    handwritten = make(lambda size: px.TensorParallel(size, rules=rules, derive=False))
    return derived, handwritten


def tensor_dims(plan: px.StatePlan) -> dict[str, str]:
    flat = jax.tree_util.tree_flatten_with_path(plan.specs.params, is_leaf=px.specs.is_spec)[0]
    return {px.specs.path_str(k): str(tuple(s)) for k, s in flat if "tensor" in px.specs.dims_axes(list(s))}


def bench(kind: str, names: list[str], rounds: int, scale: float) -> list[dict]:
    model, loss_fn, rules = build(kind, scale)
    tx = optax.adam(1e-3)
    batch = make_batch(kind, BATCH[kind], scale)
    rows = []
    for name in names:
        pair = {}
        for label, strategy in zip(("derived", "hand-written"), strategies(name, rules)):
            mesh = strategy.make_mesh()
            plan = px.plan_state(model, tx, batch, strategy=strategy, loss_fn=loss_fn, mesh=mesh)
            state = plan.build()
            placed = px.data.to_global(batch, jax.sharding.NamedSharding(mesh, strategy.batch_spec()))
            step = px.make_train_step(loss_fn, strategy)
            pair[label] = (Config(f"{name}/{label}", step, state, placed), plan)
        rows.append((name, pair))
    configs = [config for _, pair in rows for config, _ in pair.values()]
    time_interleaved(configs, rounds)
    results = []
    for name, pair in rows:
        (derived, derived_plan), (written, written_plan) = pair["derived"], pair["hand-written"]
        layout_derived, layout_written = tensor_dims(derived_plan), tensor_dims(written_plan)
        results.append({
            "model": kind, "strategy": name,
            "derived_ms": 1e3 * derived.median_s, "handwritten_ms": 1e3 * written.median_s,
            "derived_vs_handwritten": round_ratios(derived, written),
            "state_bytes": {"derived": state_bytes_per_device(derived.state),
                            "hand-written": state_bytes_per_device(written.state)},
            "collective_bytes": {"derived": derived.collective_total(), "hand-written": written.collective_total()},
            "split_fraction": derived_plan.found.of(derived_plan.strategy.parts[-1]).split_fraction,
            "only_derived": sorted(set(layout_derived.items()) - set(layout_written.items())),
            "only_handwritten": sorted(set(layout_written.items()) - set(layout_derived.items())),
            "layout": derived_plan.describe_layout(),
        })
    return results


def markdown(results: list[dict], meta: dict) -> str:
    lines = [f"# Derived tensor-parallel layout vs hand-written rules ({meta['devices']} {meta['platform']} devices, "
             f"jax {meta['jax']}, {meta['rounds']} rounds)", "",
             "| model | strategy | derived ms | hand-written ms | derived / hand-written, median (min–max) "
             "| state MB/dev derived / hand | collective MB derived / hand | params split (derived) |",
             "| --- | --- | ---: | ---: | --- | --- | --- | ---: |"]
    for r in results:
        ratio = r["derived_vs_handwritten"]
        lines.append(
            f"| {r['model']} | {r['strategy']} | {r['derived_ms']:.1f} | {r['handwritten_ms']:.1f} "
            f"| {ratio['median']:.2f} ({ratio['min']:.2f}–{ratio['max']:.2f}) "
            f"| {r['state_bytes']['derived'] / MB:.2f} / {r['state_bytes']['hand-written'] / MB:.2f} "
            f"| {r['collective_bytes']['derived'] / MB:.2f} / {r['collective_bytes']['hand-written'] / MB:.2f} "
            f"| {100 * r['split_fraction']:.1f}% |")
    lines += ["", "Where the layouts differ (param: tensor-axis spec):", ""]
    for r in results:
        lines.append(f"- {r['model']} {r['strategy']}: derived only {r['only_derived'] or 'none'}; "
                     f"hand-written only {r['only_handwritten'] or 'none'}")
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> None:
    results = []
    for kind in args.models.split(","):
        results.extend(bench(kind, args.strategies.split(","), args.rounds, args.scale))
        print(f"{kind}: done", flush=True)
    report(args, "tp_layout", results, markdown)


if __name__ == "__main__":
    main(ARGS)
