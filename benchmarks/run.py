"""Benchmark every strategy against hand-written code, one device, and the theoretical minimum.

    python -m benchmarks.run                         # the full run (make bench)
    python -m benchmarks.run --models mlp --strategies dp,fsdp --rounds 5
    python -m benchmarks.run --smoke                 # tiny models, one step: checks it still runs

Everything is measured in one process, interleaved round by round, on 8 simulated CPU
devices (or the real accelerators when ``--devices 0``). Results go to
``benchmarks/results/latest.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import os
import sys


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,lm,cnn")
    parser.add_argument("--strategies", default="dp,fsdp,tp,dp+fsdp,fsdp+tp")
    parser.add_argument("--rounds", type=int, default=7, help="timed steps per configuration")
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (0: use the real ones)")
    parser.add_argument("--scale", type=float, default=1.0, help="model width factor")
    parser.add_argument("--smoke", action="store_true", help="tiny models, one timed step each")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--no-extras", action="store_true", help="skip grad-accumulation and Trainer overhead")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.scale = 1, 0.125
    return args


ARGS = _parse() if __name__ == "__main__" else None
if ARGS is not None and ARGS.devices:
    from benchmarks import simulate_cpu_devices

    simulate_cpu_devices(ARGS.devices)

import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import parallax as px  # noqa: E402
from benchmarks import handwritten, time_interleaved  # noqa: E402
from benchmarks.models import build, make_batch  # noqa: E402
from parallax.inspect import collective_bytes, memory_bytes, state_bytes_per_device  # noqa: E402
from parallax.pricing.choice import choose, memory_budget  # noqa: E402

MIN_WEIGHT_SIZE = 2**14
BATCH = {"mlp": 256, "lm": 32, "cnn": 64}
MB = 2**20


def make_strategy(name: str, rules) -> px.Strategy:
    # The default split is priced (compiled each way) where FSDP is built; a smoke run only checks
    # that the benchmark runs, and its split search is tested elsewhere: the fixed split there.
    split = "largest" if ARGS is not None and ARGS.smoke else "auto"
    fsdp = lambda size=-1: px.FSDP(size, min_weight_size=MIN_WEIGHT_SIZE, split=split)
    tp = lambda size=-1: px.TensorParallel(size, rules=rules)
    return {
        "dp": lambda: px.DataParallel(),
        "fsdp": lambda: fsdp(),
        "tp": lambda: tp(),
        "dp+fsdp": lambda: px.combine(px.DataParallel(2), fsdp(-1)),
        "fsdp+tp": lambda: px.combine(fsdp(-1), tp(2)),
    }[name]()


class Config:
    """One way to run one step, compiled once, timed round by round."""

    def __init__(self, label: str, step, state, batch):
        self.label = label
        start = time.perf_counter()
        self.compiled = step.lower(state, batch).compile()
        self.compile_s = time.perf_counter() - start
        self.state, self.batch, self.times = state, batch, []
        self.memory = memory_bytes(self.compiled)
        self.collectives = collective_bytes(self.compiled.as_text())

    def run(self) -> float:
        start = time.perf_counter()
        self.state, out = self.compiled(self.state, self.batch)
        jax.block_until_ready((self.state, out))
        return time.perf_counter() - start

    @property
    def median_s(self) -> float:
        return statistics.median(self.times)

    def collective_total(self) -> int:
        return sum(stat.bytes for stat in self.collectives.values())


def bytes_of(tree) -> int:
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def split_bytes(params, specs, axis: str) -> tuple[int, int]:
    """Bytes of the params split over ``axis`` and of the rest."""
    split = rest = 0
    for value, spec in zip(jax.tree.leaves(params), jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))):
        nbytes = int(np.prod(value.shape)) * value.dtype.itemsize
        if axis in px.specs.dims_axes(list(spec)):
            split += nbytes
        else:
            rest += nbytes
    return split, rest


def theoretical_collectives(kind, name, params, specs, sizes, batch) -> tuple[int | None, str]:
    """The least a strategy must move per step per device, and how it was computed."""
    if name == "dp":
        return bytes_of(params), "all-reduce of all gradients"
    if name in ("fsdp", "dp+fsdp"):
        split, rest = split_bytes(params, specs, "fsdp")
        total = 2 * split + rest
        how = "all-gather + reduce-scatter of the split params, all-reduce of the rest"
        if name == "dp+fsdp":
            total += split // sizes["fsdp"]
            how += ", all-reduce of the shards over data"
        return total, how
    if kind == "mlp" and name in ("tp", "fsdp+tp"):
        rows = batch["x"].shape[0] // (sizes.get("fsdp", 1))
        activations = 3 * rows * batch["x"].shape[1] * 4  # 2 forward + 1 backward all-reduce (B, D)
        if name == "tp":
            return activations, "activation all-reduces: 2 forward, 1 backward"
        split, rest = split_bytes(params, specs, "fsdp")
        tensor_split, _ = split_bytes(params, specs, "tensor")
        both = 2 * split // sizes["tensor"] if tensor_split else 2 * split
        return activations + both + rest, "activation all-reduces + FSDP of the tensor shards"
    return None, "not derived for this model"


def bench_model(kind: str, names: list[str], rounds: int, scale: float) -> list[dict]:
    model, loss_fn, rules = build(kind, scale)
    tx = optax.adam(1e-3)
    batch = make_batch(kind, BATCH[kind], scale)
    single_step, single_state, single_batch = handwritten.single_device(model, tx, loss_fn, batch)
    single = Config("1 device", single_step, single_state, single_batch)
    rows, configs = [], [single]
    for name in names:
        strategy = make_strategy(name, rules if "tp" in name else None)
        mesh = strategy.make_mesh()
        state = px.init_state(model, tx, batch, strategy=strategy, loss_fn=loss_fn, mesh=mesh)
        placed = px.data.to_global(batch, jax.sharding.NamedSharding(mesh, strategy.batch_spec()))
        modes = ["shard_map", "jit"] if strategy.data_axes else ["jit"]
        ours = []
        for mode in modes:
            step = px.make_train_step(loss_fn, strategy, compile=mode)
            fresh = px.init_state(model, tx, batch, strategy=strategy, loss_fn=loss_fn, mesh=mesh)
            ours.append(Config(f"parallax/{mode}", step, fresh, placed))
        state_specs = px.step.state_specs_of(state)[1]
        specs = state_specs.params
        if name == "dp":
            base = Config("hand-written", *handwritten.data_parallel(model, tx, loss_fn, batch, mesh))
        elif name == "fsdp":
            base = Config("hand-written", *handwritten.fsdp(model, tx, loss_fn, batch, mesh,
                                                           min_weight_size=MIN_WEIGHT_SIZE))
        else:
            base = Config("hand-written (jit)", *handwritten.gspmd(model, tx, loss_fn, batch, mesh, specs,
                                                                   state_specs.opt_state, strategy.batch_spec()))
        configs.extend(ours + [base])
        # What compile="auto" picks: for a loss as written (exact for any loss), and for one
        # marked px.per_example_loss (may run per data shard).
        by_path = {c.label.split("/")[1]: c for c in ours}
        defaults = {"default": default_path(loss_fn, strategy, by_path),
                    "default_per_example": default_path(px.per_example_loss(loss_fn), strategy, by_path)}
        rows.append({"model": kind, "strategy": name, "describe": strategy.describe(), "ours": ours, "base": base,
                     "defaults": defaults,
                     "state": state, "specs": specs, "sizes": strategy.axis_sizes(mesh), "batch": batch})
        del state
    time_interleaved(configs, rounds)
    results = []
    params = single_state[0]
    total_state = bytes_of(single.state[0]) + bytes_of(single.state[2])
    for row in rows:
        best = min(row["ours"], key=lambda c: c.median_s)
        minimum, how = theoretical_collectives(kind, row["strategy"], params, row["specs"], row["sizes"],
                                               row["batch"])
        state_bytes = state_bytes_per_device(best.state)
        ideal = ideal_state_bytes(best.state, row["specs"], row["sizes"])
        moved = best.collective_total()
        results.append({
            "model": kind, "strategy": row["strategy"], "layout": row["describe"], "best": best.label,
            "params": int(sum(np.prod(x.shape) for x in jax.tree.leaves(params))),
            "step_ms": {c.label: 1e3 * c.median_s for c in row["ours"] + [row["base"]]},
            "single_device_ms": 1e3 * single.median_s,
            "ratio_to_handwritten": best.median_s / row["base"].median_s,
            "ratio_to_single_device": best.median_s / single.median_s,
            "state_bytes_per_device": state_bytes, "ideal_state_bytes": ideal,
            "state_ratio_to_ideal": state_bytes / ideal, "single_device_state_bytes": total_state,
            "memory": {c.label: c.memory for c in row["ours"] + [row["base"]]},
            "collectives": {c.label: {k: vars(v) for k, v in c.collectives.items()}
                            for c in row["ours"] + [row["base"]]},
            "collective_bytes": moved, "handwritten_collective_bytes": row["base"].collective_total(),
            "theoretical_collective_bytes": minimum, "theoretical_how": how,
            "collective_ratio": (moved / minimum) if minimum else None,
            "collective_ratio_by_config": {c.label: (c.collective_total() / minimum if minimum else None)
                                           for c in row["ours"] + [row["base"]]},
            "compile_s": {c.label: c.compile_s for c in row["ours"] + [row["base"]]},
            **{name: f"parallax/{mode}" for name, mode in row["defaults"].items()},
            **{f"{name}_vs_best": round_ratios(next(c for c in row["ours"] if c.label == f"parallax/{mode}"), best)
               for name, mode in row["defaults"].items()},
        })
    return results


def default_path(loss_fn, strategy, compiled: dict[str, Config]) -> str:
    """The compile path ``compile="auto"`` takes for this loss: the step reads the loss's proof
    (a trace; nothing compiles), then the cost model prices the benchmark's own compiled
    programs of each path (``compiled``: path -> :class:`Config` on the same state and batch),
    as the step would price its own; a path missing from ``compiled`` did not compile)."""
    config = next(iter(compiled.values()))
    step = px.make_train_step(loss_fn, strategy)
    step.prove(config.state, config.batch)
    modes = step.modes()
    if len(modes) == 1:
        return modes[0]
    devices = list(px.step.state_specs_of(config.state)[0].devices.flat)
    programs = {mode: compiled[mode].compiled for mode in modes if mode in compiled}  # a path may not compile
    return choose(programs, devices, memory_budget(None, devices)).picked


def round_ratios(config: Config, reference: Config) -> dict[str, float]:
    """``config``'s step time over ``reference``'s, round by round: min / median / max."""
    ratios = np.array(config.times) / np.array(reference.times)
    return {"min": float(ratios.min()), "median": float(np.median(ratios)), "max": float(ratios.max())}


def ideal_state_bytes(state, param_specs, sizes) -> int:
    """Params and optimizer state per device if every split leaf were exactly 1/N."""
    specs = px.step.state_specs_of(state)[1]
    total = 0
    for leaf, spec in zip(jax.tree.leaves(state), jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))):
        divisor = int(np.prod([sizes[a] for a in px.specs.dims_axes(list(spec))])) if len(spec) else 1
        total += int(np.prod(leaf.shape)) * leaf.dtype.itemsize // divisor
    return total


def bench_grad_accum(rounds: int, scale: float) -> dict:
    model, loss_fn, _ = build("mlp", scale)
    tx = optax.adam(1e-3)
    batch = make_batch("mlp", 512, scale)
    strategy = px.FSDP(min_weight_size=MIN_WEIGHT_SIZE, split="largest")  # one split: the accumulation is compared
    mesh = strategy.make_mesh()
    placed = px.data.to_global(batch, jax.sharding.NamedSharding(mesh, strategy.batch_spec()))
    configs = {}
    for k in (1, 4):
        state = px.init_state(model, tx, batch, strategy=strategy, loss_fn=loss_fn, mesh=mesh)
        step = px.make_train_step(loss_fn, strategy, grad_accum=k, compile="shard_map")
        configs[k] = Config(f"k={k}", step, state, placed)
    for _ in range(rounds + 1):
        for config in configs.values():
            config.times.append(config.run())
    return {f"k={k}": {"step_ms": 1e3 * statistics.median(c.times[1:]),
                       "collectives": {n: vars(s) for n, s in c.collectives.items()},
                       "temp_bytes": c.memory["temporaries"]} for k, c in configs.items()}


def bench_trainer_overhead(steps: int) -> dict:
    """steps/s of Trainer.fit against a bare loop over the same jitted step and data."""
    import flax.linen as nn

    class Tiny(nn.Module):
        @nn.compact
        def __call__(self, x, train=True):
            return nn.Dense(10)(nn.relu(nn.Dense(32)(x)))

    def loss_fn(model, batch):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), {
            "accuracy": (logits.argmax(-1) == batch["y"]).mean()}

    rng = np.random.default_rng(0)
    data = {"x": rng.normal(size=(64 * steps, 16)).astype(np.float32), "y": rng.integers(0, 10, 64 * steps)}
    strategy = px.DataParallel()
    trainer = px.Trainer(Tiny(), optax.sgd(0.1), loss_fn, strategy=strategy, max_steps=steps, batch_size=64,
                         shuffle=False, progress=False)
    trainer.fit(data)  # compiles
    fit_times, bare_times = [], []
    for _ in range(5):
        start = time.perf_counter()
        trainer.fit(data)
        fit_times.append(time.perf_counter() - start)
        source = px.data.ArrayData(data, 64, shuffle=False)
        state = trainer.init(px.data.ArrayData(data, 64, shuffle=False).arrays)
        start = time.perf_counter()
        batches = source.iter_from(0)
        previous = None
        for _ in range(steps):
            state, metrics = trainer.train_step(state, px.data.to_global(next(batches), trainer.batch_sharding))
            if previous is not None:
                jax.block_until_ready(previous)  # at most two steps in flight, as in fit
            previous = metrics
        jax.block_until_ready(metrics)
        bare_times.append(time.perf_counter() - start)
    fit_s, bare_s = min(fit_times), min(bare_times)
    return {"steps": steps, "fit_steps_per_s": steps / fit_s, "bare_steps_per_s": steps / bare_s,
            "ratio": bare_s / fit_s}


def spread(row: dict, name: str) -> str:
    """``jit 1.00`` or ``jit 1.93 (1.71–2.20)``: the path picked and its step time over the best's."""
    ratio = row[f"{name}_vs_best"]
    mode = row[name].split("/")[1]
    if row[name] == row["best"]:
        return f"{mode} 1.00"
    return f"{mode} {ratio['median']:.2f} ({ratio['min']:.2f}–{ratio['max']:.2f})"


def markdown(results: list[dict], extras: dict, meta: dict) -> str:
    lines = [f"# parallax benchmarks ({meta['devices']} {meta['platform']} devices, jax {meta['jax']})", "",
             "Median step time over interleaved rounds in one process; bytes from the compiled HLO and "
             "`memory_analysis()` (per device).", "",
             "| model | strategy | parallax best | step ms | vs hand-written | vs 1 device | state MB/dev "
             "| ideal MB | temp MB | collective MB | minimum MB | ratio | compile s | default (exact) vs best "
             "| per-example default vs best |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in results:
        best = r["best"]
        minimum = r["theoretical_collective_bytes"]
        minimum_text = "" if minimum is None else f"{minimum / MB:.2f}"
        ratio_text = "" if r["collective_ratio"] is None else f"{r['collective_ratio']:.2f}"
        lines.append(
            f"| {r['model']} | {r['strategy']} | {best.split('/')[1]} | {r['step_ms'][best]:.1f} "
            f"| {r['ratio_to_handwritten']:.2f} | {r['ratio_to_single_device']:.2f} "
            f"| {r['state_bytes_per_device'] / MB:.2f} | {r['ideal_state_bytes'] / MB:.2f} "
            f"| {r['memory'][best]['temporaries'] / MB:.2f} | {r['collective_bytes'] / MB:.2f} "
            f"| {minimum_text} | {ratio_text} "
            f"| {r['compile_s'][best]:.1f} | {spread(r, 'default')} | {spread(r, 'default_per_example')} |")
    lines += ["", "Hand-written baselines: DP and FSDP are the `shard_map` notebook recipes "
              "(`benchmarks/handwritten.py`); TP and hybrids are `jax.jit` with `NamedSharding`s.", ""]
    if "grad_accum" in extras:
        lines += ["## Gradient accumulation under FSDP (MLP, batch 512, `compile=\"shard_map\"`)", "",
                  "| | step ms | all-gather MB | reduce-scatter MB (count) | temp MB |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        for k, v in extras["grad_accum"].items():
            c = v["collectives"]
            lines.append(f"| {k} | {v['step_ms']:.1f} | {c['all-gather']['bytes'] / MB:.2f} "
                         f"| {c['reduce-scatter']['bytes'] / MB:.2f} ({c['reduce-scatter']['count']}) "
                         f"| {v['temp_bytes'] / MB:.2f} |")
        lines.append("")
    if "trainer" in extras:
        t = extras["trainer"]
        lines += ["## Trainer.fit host overhead (tiny model)", "",
                  f"Trainer.fit {t['fit_steps_per_s']:.1f} steps/s, bare loop over the same step "
                  f"{t['bare_steps_per_s']:.1f} steps/s: ratio {t['ratio']:.3f} (goal ≥ 0.95).", ""]
    return "\n".join(lines)


def chart(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['model']}\n{r['strategy']}" for r in results]
    x = np.arange(len(results))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(8, len(results) * 0.8), 7))
    top.bar(x - 0.25, [r["step_ms"][r["best"]] for r in results], 0.25, label="parallax")
    top.bar(x, [min(v for k, v in r["step_ms"].items() if not k.startswith("parallax")) for r in results], 0.25,
            label="hand-written")
    top.bar(x + 0.25, [r["single_device_ms"] for r in results], 0.25, label="1 device")
    top.set_ylabel("step time (ms)")
    top.set_xticks(x, labels, fontsize=7)
    top.legend()
    bottom.bar(x - 0.2, [r["state_bytes_per_device"] / MB for r in results], 0.4, label="state per device")
    bottom.bar(x + 0.2, [r["single_device_state_bytes"] / MB for r in results], 0.4, label="1 device")
    bottom.set_ylabel("MB")
    bottom.set_xticks(x, labels, fontsize=7)
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(args: argparse.Namespace) -> dict:
    models = [m for m in args.models.split(",") if m]
    names = [s for s in args.strategies.split(",") if s]
    results = []
    for kind in models:
        print(f"benchmarking {kind} ...", flush=True)
        results.extend(bench_model(kind, names, args.rounds, args.scale))
    extras = {}
    if not args.no_extras:
        print("benchmarking gradient accumulation and Trainer overhead ...", flush=True)
        extras["grad_accum"] = bench_grad_accum(args.rounds, args.scale)
        extras["trainer"] = bench_trainer_overhead(20 if args.smoke else 300)
    meta = {"devices": jax.device_count(), "platform": jax.devices()[0].platform, "jax": jax.__version__,
            "rounds": args.rounds, "scale": args.scale, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    report = {"meta": meta, "results": results, "extras": extras}
    os.makedirs(args.out, exist_ok=True)
    stem = "smoke" if args.smoke else "latest"
    with open(os.path.join(args.out, f"{stem}.json"), "w") as stream:
        json.dump(report, stream, indent=1, default=float)
    table = markdown(results, extras, meta)
    with open(os.path.join(args.out, f"{stem}.md"), "w") as stream:
        stream.write(table + "\n")
    chart(results, os.path.join(args.out, f"{stem}.png"))
    print(table)
    return report


if __name__ == "__main__":
    main(ARGS)
