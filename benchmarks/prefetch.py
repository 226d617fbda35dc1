"""Host-to-device prefetch on a slow loader: Trainer steps/s with and without it, against the bare loop.

    python -m benchmarks.prefetch                     # 8 simulated CPU devices, the MLP, FSDP
    python -m benchmarks.prefetch --delay 0.02 --rounds 5
    python -m benchmarks.prefetch --smoke             # a tiny model, one round: checks it still runs

A loader that sleeps ``--delay`` seconds per batch (a slow disk or a remote store) feeds three
runs of ``--steps`` steps of the benchmark MLP under FSDP (AdamW):

* ``bare loop``: the jitted train step (``px.make_train_step``) in a hand-written loop that
  reads a batch, places it (``px.data.to_global``), runs the step and reads the previous
  step's loss (one step in flight, as the Trainer keeps);
* ``Trainer(prefetch=0)``: batches read and placed in the training loop, between steps;
* ``Trainer(prefetch=2)`` (the default): the next two batches read and placed by a background
  thread while the step runs.

Every run reads its loss each step (``fetch_every=1``) and records when; steps/s is taken over
the steps after the second (compilation and warm-up excluded). The three run in a fresh random
order each round; the table gives each one's steps/s (median, min–max over rounds) and its ratio
to the bare loop's in the same round. Results go to ``benchmarks/results/prefetch.{json,md}``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import RESULTS, simulate_cpu_devices, write_results  # noqa: E402


class SlowLoader:
    """Yields ``batch`` ``steps`` times, sleeping ``delay`` seconds before each (re-iterable)."""

    def __init__(self, batch, steps: int, delay: float):
        self.batch, self.steps, self.delay = batch, steps, delay

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        for _ in range(self.steps):
            time.sleep(self.delay)
            yield self.batch


class StepTimes:
    """A callback noting when each step's loss was read."""

    def __init__(self):
        self.at: dict[int, float] = {}

    def on_step(self, info) -> None:
        self.at[info.step] = time.perf_counter()


def steps_per_second(at: dict[int, float], steps: int) -> float:
    return (steps - 2) / (at[steps] - at[2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--delay", type=float, default=0.01, help="seconds the loader sleeps per batch")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.steps, args.delay = 1, 6, 0.005
    simulate_cpu_devices(args.devices)

    import jax
    import numpy as np
    import optax
    from jax.sharding import NamedSharding

    import parallax as px
    from benchmarks.models import build, make_batch
    from benchmarks.run import BATCH, MIN_WEIGHT_SIZE

    scale = 0.125 if args.smoke else 0.5
    model, loss_fn, _ = build("mlp", scale)
    batch = make_batch("mlp", BATCH["mlp"], scale)
    strategy = px.FSDP(min_weight_size=MIN_WEIGHT_SIZE)
    tx = optax.adamw(1e-3)
    loader = SlowLoader(batch, args.steps, args.delay)

    state0 = px.init_state(model, tx, batch, strategy=strategy, loss_fn=loss_fn)
    mesh = state0.step.sharding.mesh
    sharding = NamedSharding(mesh, strategy.batch_spec())
    bare_step = px.make_train_step(loss_fn, strategy)

    def bare() -> float:
        state = jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, state0)
        times, previous = StepTimes(), None
        for step, host_batch in enumerate(loader, start=1):
            state, metrics = bare_step(state, px.data.to_global(host_batch, sharding))
            if previous is not None:  # the previous step's loss, read while this one runs (as the Trainer does)
                float(previous["loss"])
                times.at[step - 1] = time.perf_counter()
            previous = metrics
        float(previous["loss"])
        times.at[args.steps] = time.perf_counter()
        return steps_per_second(times.at, args.steps)

    trainers = {}

    def trainer_run(depth: int) -> float:
        times = StepTimes()
        if depth not in trainers:
            trainers[depth] = px.Trainer(model, tx, loss_fn, strategy=strategy, max_steps=args.steps, prefetch=depth,
                                         fetch_every=1, progress=False, summary=False, callbacks=[times])
        trainer = trainers[depth]
        trainer.callbacks = [times]
        trainer.fit(loader)
        return steps_per_second(times.at, args.steps)

    runs = {"bare loop": bare, "Trainer(prefetch=0)": lambda: trainer_run(0),
            "Trainer(prefetch=2)": lambda: trainer_run(2)}
    for run in runs.values():  # compile, warm up
        run()
    rates = {name: [] for name in runs}
    order = np.random.default_rng(0)
    for _ in range(args.rounds):
        for name in order.permutation(list(runs)):
            rates[name].append(runs[name]())
    ideal = 1 / max(args.delay, 1e-9)
    results = []
    for name, values in rates.items():
        ratios = [value / bare_rate for value, bare_rate in zip(values, rates["bare loop"])]
        results.append({"run": name, "steps_per_s": values, "median": float(np.median(values)),
                        "min": float(np.min(values)), "max": float(np.max(values)),
                        "ratio_to_bare": {"median": float(np.median(ratios)), "min": float(np.min(ratios)),
                                          "max": float(np.max(ratios))}})
    meta = {"devices": jax.device_count(), "platform": jax.devices()[0].platform, "jax": jax.__version__,
            "rounds": args.rounds, "steps": args.steps, "delay_s": args.delay, "loader_bound_steps_per_s": ideal}
    lines = ["# Prefetch on a slow loader", "",
             f"{meta['devices']} {meta['platform']} devices, MLP (scale {scale}) under FSDP, AdamW; the loader sleeps "
             f"{args.delay * 1e3:g} ms per batch (at most {ideal:.0f} steps/s from the loader alone); "
             f"{args.steps} steps per run, {args.rounds} rounds interleaved.", "",
             "| run | steps/s median (min–max) | ÷ bare loop median (min–max) |", "|---|---|---|"]
    for row in results:
        ratio = row["ratio_to_bare"]
        lines.append(f"| {row['run']} | {row['median']:.1f} ({row['min']:.1f}–{row['max']:.1f}) | "
                     f"{ratio['median']:.2f} ({ratio['min']:.2f}–{ratio['max']:.2f}) |")
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.smoke:
        write_results(args.out, "prefetch", meta, results, text)


if __name__ == "__main__":
    main()
