"""Host-to-device prefetch on a slow loader: Trainer steps/s with and without it, against the bare loop.

    python -m benchmarks.prefetch                     # 8 simulated CPU devices, the MLP, FSDP
    python -m benchmarks.prefetch --delay 0.02 --rounds 5
    python -m benchmarks.prefetch --smoke             # a tiny model, one round: checks it still runs

Two loaders that take ``--delay`` seconds per batch on average feed three runs of ``--steps``
steps of the benchmark MLP under FSDP (AdamW): a *steady* one that sleeps ``--delay`` before
every batch (a slow disk), and a *bursty* one that sleeps ``4 × --delay`` before every fourth
batch and not at all otherwise (a remote store with latency spikes):

* ``bare loop``: the jitted train step (``px.make_train_step``) in a hand-written loop that
  reads a batch, places it (``px.data.to_global``), runs the step and reads the previous
  step's loss (one step in flight, as the Trainer keeps);
* ``Trainer(prefetch=0)``: batches read and placed in the training loop, between steps;
* ``Trainer(prefetch=2)`` (the default): the next two batches read and placed by a background
  thread while the step runs.

Every run reads its loss each step (``fetch_every=1``) and records when; steps/s is taken over
the steps after the second (compilation and warm-up excluded). The runs go in a fresh random
order each round; the table gives each one's steps/s (median, min–max over rounds) and its ratio
to the bare loop's in the same round. Results go to ``benchmarks/results/prefetch.{json,md}``.

What to expect: JAX dispatches steps asynchronously and every loop here keeps one step in
flight, so a steady loader faster than the step is hidden already, with or without prefetch;
the buffer pays where the loader's time varies (the bursty loader), as long as its mean stays
below the step time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import RESULTS, simulate_cpu_devices, write_results


class SlowLoader:
    """Yields ``batch`` ``steps`` times, ``delay`` seconds per batch on average (re-iterable):
    before each (``burst=1``), or ``burst × delay`` before every ``burst``-th one."""

    def __init__(self, batch, steps: int, delay: float, burst: int = 1):
        self.batch, self.steps, self.delay, self.burst = batch, steps, delay, burst

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        for index in range(self.steps):
            if index % self.burst == 0:
                time.sleep(self.delay * self.burst)
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
    parser.add_argument("--delay", type=float, default=0.015, help="seconds the loader takes per batch, on average")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
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
    loaders = {"steady": SlowLoader(batch, args.steps, args.delay),
               "bursty": SlowLoader(batch, args.steps, args.delay, 4)}

    state0 = px.init_state(model, tx, batch, strategy=strategy, loss_fn=loss_fn)
    mesh = state0.step.sharding.mesh
    sharding = NamedSharding(mesh, strategy.batch_spec())
    bare_step = px.make_train_step(loss_fn, strategy)

    def bare(loader) -> float:
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

    def trainer_run(depth: int, loader) -> float:
        times = StepTimes()
        if depth not in trainers:
            trainers[depth] = px.Trainer(model, tx, loss_fn, strategy=strategy, max_steps=args.steps, prefetch=depth,
                                         fetch_every=1, progress=False, summary=False, callbacks=[times])
        trainer = trainers[depth]
        trainer.callbacks = [times]
        trainer.fit(loader)
        return steps_per_second(times.at, args.steps)

    runs = {}
    for kind, loader in loaders.items():
        runs[(kind, "bare loop")] = lambda loader=loader: bare(loader)
        for depth in (0, 2):
            runs[(kind, f"Trainer(prefetch={depth})")] = lambda loader=loader, depth=depth: trainer_run(depth, loader)
    for run in runs.values():  # compile, warm up
        run()
    rates = {key: [] for key in runs}
    order = np.random.default_rng(0)
    for _ in range(args.rounds):
        for index in order.permutation(len(runs)):
            key = list(runs)[index]
            rates[key].append(runs[key]())
    ideal = 1 / max(args.delay, 1e-9)
    results = []
    for (kind, name), values in rates.items():
        ratios = [value / bare_rate for value, bare_rate in zip(values, rates[(kind, "bare loop")])]
        results.append({"loader": kind, "run": name, "steps_per_s": values, "median": float(np.median(values)),
                        "min": float(np.min(values)), "max": float(np.max(values)),
                        "ratio_to_bare": {"median": float(np.median(ratios)), "min": float(np.min(ratios)),
                                          "max": float(np.max(ratios))}})
    meta = {"devices": jax.device_count(), "platform": jax.devices()[0].platform, "jax": jax.__version__,
            "rounds": args.rounds, "steps": args.steps, "delay_s": args.delay, "loader_bound_steps_per_s": ideal}
    lines = ["# Prefetch on a slow loader", "",
             f"{meta['devices']} {meta['platform']} devices, MLP (scale {scale}) under FSDP, AdamW; the loaders take "
             f"{args.delay * 1e3:g} ms per batch on average (at most {ideal:.0f} steps/s from the loader alone): "
             f"steady, or {4 * args.delay * 1e3:g} ms before every 4th batch (bursty); {args.steps} steps per run, "
             f"{args.rounds} rounds interleaved.", "",
             "| loader | run | steps/s median (min–max) | ÷ bare loop median (min–max) |", "|---|---|---|---|"]
    for row in results:
        ratio = row["ratio_to_bare"]
        lines.append(f"| {row['loader']} | {row['run']} | {row['median']:.1f} ({row['min']:.1f}–{row['max']:.1f}) | "
                     f"{ratio['median']:.2f} ({ratio['min']:.2f}–{ratio['max']:.2f}) |")
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.smoke:
        write_results(args.out, "prefetch", meta, results, text)


if __name__ == "__main__":
    main()
