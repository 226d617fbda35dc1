"""The cost model against measured step times: every candidate plan of every benchmark model.

    python -m benchmarks.cost_model                    # 8 simulated CPU devices, MLP, LM and CNN
    python -m benchmarks.cost_model --models mlp --rounds 3
    python -m benchmarks.cost_model --smoke            # tiny models, one round: checks it still runs

For each model (``benchmarks/models.py``, Adam, the loss marked ``px.per_example_loss`` so that
both compile paths are exact): every DP × FSDP × TP mesh of the devices
(``parallax.parallel.candidates.candidates``, FSDP splitting params above 2**14 elements as in the
other benchmarks), each compile path (``jit``, and ``shard_map`` where the batch is split),
and, on meshes with an FSDP axis, each ``FSDP(split=...)``. Each candidate is compiled once,
priced by the cost model (``parallax.pricing.cost``, speeds calibrated on these devices) and
timed in interleaved rounds in one process.

Reported per model: predicted against measured step time for every candidate, the rank
correlation (Spearman) and the worst relative error; what ``strategy="auto"`` picks (the same
search ``init_state`` runs, timing its close calls included, and what it cost) against the
measured fastest candidate, and what the cost model alone would have picked, with no memory
budget and with a budget that excludes data parallelism; and for each mesh, what the
defaults run (``compile="auto"`` for the loss as written and for the marked loss, split
``largest``) against the fastest configuration of that mesh (the same state per device).
Results go to ``benchmarks/results/cost_model.{json,md}``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from benchmarks import report, side_runner_args, time_interleaved

ARGS = side_runner_args(__doc__, models="mlp,lm,cnn", rounds=7) if __name__ == "__main__" else None

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import parallax as px  # noqa: E402
from benchmarks.models import build, make_batch  # noqa: E402
from benchmarks.run import BATCH, MB, MIN_WEIGHT_SIZE, Config, default_path, round_ratios  # noqa: E402
from parallax.inspect import state_bytes_per_device  # noqa: E402
from parallax.parallel.candidates import candidates, split_candidates  # noqa: E402
from parallax.pricing import cost  # noqa: E402
from parallax.pricing.choice import rank  # noqa: E402
from parallax.state.search import resolve  # noqa: E402


def spearman(a, b) -> float:
    ranks = lambda v: np.argsort(np.argsort(np.asarray(v)))
    return float(np.corrcoef(ranks(a), ranks(b))[0, 1]) if len(a) > 2 else float("nan")


def label_of(strategy, mesh, mode: str) -> str:
    splits = [p.split for p in strategy.parts if isinstance(p, px.FSDP) and p.split != "largest"]
    return f"{strategy.describe(mesh)}, {mode}" + (f", split={splits[0]}" if splits else "")


def bench(kind: str, rounds: int, scale: float) -> dict:
    model, loss_fn, _ = build(kind, scale)
    marked = px.per_example_loss(loss_fn)
    tx = optax.adam(1e-3)
    batch = make_batch(kind, BATCH[kind], scale)
    devices = jax.devices()
    speeds = cost.calibrate(devices, refresh=True)  # measured now, under the load the timings will see
    pool = candidates(len(devices), fsdp=px.FSDP(min_weight_size=MIN_WEIGHT_SIZE))
    configs, rows, skipped, meshes = {}, {}, {}, {}
    every_split = candidates(len(devices), fsdp=px.FSDP(min_weight_size=MIN_WEIGHT_SIZE, split="auto"))
    for base, searched in zip(pool, every_split):  # the same meshes in the same order
        mesh = base.make_mesh(devices)
        variants = split_candidates(searched)  # each split on meshes with an FSDP axis; the others as they are
        placed = px.data.to_global(batch, jax.sharding.NamedSharding(mesh, base.batch_spec()))
        for strategy in variants:
            modes = ["jit", "shard_map"] if strategy.data_axes else ["jit"]
            for mode in modes:
                label = label_of(strategy, mesh, mode)
                try:
                    state = px.init_state(model, tx, batch, strategy=strategy, loss_fn=marked, mesh=mesh)
                    config = Config(label, px.make_train_step(marked, strategy, compile=mode), state, placed)
                except ValueError as err:
                    skipped[label] = str(err).splitlines()[0]
                    continue
                configs[label] = config
                meshes[label] = base.describe(mesh)
                rows[label] = {"estimate": cost.estimate(config.compiled, speeds),
                               "state_bytes": state_bytes_per_device(state)}
        # What the defaults run on this mesh: compile="auto", split "largest".
        if base.describe(mesh) + ", jit" in configs:
            by_path = {mode: configs[label] for mode in ("jit", "shard_map")
                       if (label := f"{base.describe(mesh)}, {mode}") in configs}
            defaults = {"as written": default_path(loss_fn, base, by_path),
                        "marked": default_path(marked, base, by_path)}
            rows[base.describe(mesh) + ", jit"]["defaults"] = defaults
    time_interleaved(list(configs.values()), rounds)

    start = time.perf_counter()
    found = resolve(model, tx, batch, "auto", loss_fn=marked, among=pool)
    search_s = time.perf_counter() - start
    dp_peak = min(r["estimate"].peak for label, r in rows.items() if label.startswith("DataParallel(data=8)"))
    budgets = {"none": None, "below DP's peak": dp_peak - 1}
    picks = {}
    for name, budget in budgets.items():  # the search as a user runs it, timing its close calls included
        searched = found if budget is None else resolve(model, tx, batch, "auto", loss_fn=marked, among=pool,
                                                        options=px.StepOptions(memory_budget=budget))
        picked = searched.choice.picked
        by_model = rank(searched.choice.estimates, budget, what="strategy").picked  # the cost model's own pick
        fitting = [c for label, c in configs.items() if budget is None or rows[label]["estimate"].peak <= budget]
        fastest = min(fitting, key=lambda c: c.median_s)
        picks[name] = {"budget": budget, "picked": picked, "fastest": fastest.label,
                       "vs_fastest": round_ratios(configs[picked], fastest) if picked in configs else None,
                       "timed_ms": {label: 1e3 * t for label, t in searched.timed.items()},
                       "cost_model_pick": by_model,
                       "cost_model_vs_fastest": (round_ratios(configs[by_model], fastest) if by_model in configs
                                                 else None)}
    results = []
    for label, config in configs.items():
        est = rows[label]["estimate"]
        same_mesh = [c for lab, c in configs.items() if meshes[lab] == meshes[label]]
        entry = {"model": kind, "config": label, "mesh": meshes[label], "measured_ms": 1e3 * config.median_s,
                 "predicted_ms": 1e3 * est.seconds, "error": est.seconds / config.median_s - 1,
                 "estimate": dict(vars(est).items()), "state_bytes": rows[label]["state_bytes"],
                 "compile_s": config.compile_s}
        if "defaults" in rows[label]:
            fastest = min(same_mesh, key=lambda c: c.median_s)
            entry["defaults"] = {name: {"config": f"{meshes[label]}, {mode}", "fastest": fastest.label,
                                        "vs_fastest": round_ratios(configs[f"{meshes[label]}, {mode}"], fastest)}
                                 for name, mode in rows[label]["defaults"].items()}
        results.append(entry)
    measured = [r["measured_ms"] for r in results]
    predicted = [r["predicted_ms"] for r in results]
    return {"model": kind, "rows": results, "skipped": skipped, "spearman": spearman(predicted, measured),
            "worst_error": max(results, key=lambda r: abs(r["error"]))["error"],
            "auto": {"picks": picks, "search_s": search_s, "describe": found.describe()},
            "speeds": vars(speeds)}


def ratio(v) -> str:
    return "" if v is None else f"{v['median']:.2f} ({v['min']:.2f}–{v['max']:.2f})"


def markdown(results: list[dict], meta: dict) -> str:
    lines = [f"# The cost model against measured step times ({meta['devices']} {meta['platform']} devices, "
             f"jax {meta['jax']}, {meta['rounds']} rounds, Adam)", ""]
    for model in results:
        lines += [f"## {model['model']}: rank correlation {model['spearman']:.2f}, worst error "
                  f"{100 * model['worst_error']:+.0f}% ({len(model['rows'])} candidates)", ""]
        for name, pick in model["auto"]["picks"].items():
            lines.append(f"- `strategy=\"auto\"`, budget {name}: picks **{pick['picked']}**; measured fastest "
                         f"{pick['fastest']}; pick / fastest {ratio(pick['vs_fastest'])}")
            if pick["timed_ms"]:
                lines.append("  - timed by the search: " + ", ".join(
                    f"{label} {ms:.1f} ms" for label, ms in sorted(pick["timed_ms"].items(), key=lambda x: x[1]))
                    + f"; the cost model alone picks {pick['cost_model_pick']}: "
                    f"{ratio(pick['cost_model_vs_fastest'])} of the fastest")
        lines += [f"- the search: {model['auto']['describe']}", "",
                  "| candidate | predicted ms | measured ms | error | state MB/dev | peak MB | moved MB | "
                  "transposed MB |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in sorted(model["rows"], key=lambda r: r["measured_ms"]):
            e = r["estimate"]
            lines.append(f"| {r['config']} | {r['predicted_ms']:.1f} | {r['measured_ms']:.1f} "
                         f"| {100 * r['error']:+.0f}% | {r['state_bytes'] / MB:.2f} | {e['peak'] / MB:.1f} "
                         f"| {e['moved'] / MB:.1f} "
                         f"| {e['transposed'] / MB:.1f} |")
        lines += ["", "Defaults on each mesh (split `largest`, `compile=\"auto\"`) against that mesh's fastest "
                  "configuration, round by round:", "",
                  "| mesh | loss as written | / fastest | marked per-example | / fastest | fastest |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for r in model["rows"]:
            if "defaults" in r:
                d = r["defaults"]
                lines.append(f"| {r['mesh']} | {d['as written']['config'].split(', ')[-1]} | "
                             f"{ratio(d['as written']['vs_fastest'])} | {d['marked']['config'].split(', ')[-1]} | "
                             f"{ratio(d['marked']['vs_fastest'])} | {d['marked']['fastest']} |")
        if model["skipped"]:
            lines += ["", "Skipped: " + "; ".join(f"{k}: {v}" for k, v in model["skipped"].items())]
        lines.append("")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> None:
    results = []
    for kind in args.models.split(","):
        results.append(bench(kind, args.rounds, args.scale))
        print(f"{kind}: rank correlation {results[-1]['spearman']:.2f}", flush=True)
    report(args, "cost_model", results, markdown)


if __name__ == "__main__":
    main(ARGS)
