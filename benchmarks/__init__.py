"""Benchmarks of parallax against hand-written code (``python -m benchmarks.run``).

The helpers here import no JAX: a runner parses its arguments and sets up the simulated
devices (:func:`side_runner_args`) before JAX starts.
"""

import argparse
import json
import os
from collections.abc import Callable, Sequence

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def simulate_cpu_devices(count: int) -> None:
    """Makes JAX start ``count`` simulated CPU devices; call before JAX is imported."""
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def side_runner_args(doc: str, *, models: str, rounds: int = 9, switches: tuple[str, ...] = (),
                     **lists: str) -> argparse.Namespace:
    """The arguments of a comparison runner (``--models``, one option per ``lists`` entry with its
    default, one on/off flag per ``switches`` entry, ``--rounds``, ``--devices``, ``--smoke``,
    ``--out``); starts the simulated devices."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=models)
    for name, default in lists.items():
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, default=default)
    for name in switches:
        parser.add_argument(f"--{name}", action="store_true")
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--smoke", action="store_true", help="tiny models, one round")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args()
    args.scale = 0.125 if args.smoke else 1.0
    if args.smoke:
        args.rounds = 1
    if args.devices:
        simulate_cpu_devices(args.devices)
    return args


def time_interleaved(runners: list, rounds: int, warmup: int = 2) -> None:
    """Runs each runner ``warmup`` times, then ``rounds`` times in a fresh random order each round
    (no configuration always follows the same one: a heavy predecessor leaves cold caches
    behind), appending each step time to its ``times``."""
    import numpy as np

    for _ in range(warmup):
        for runner in runners:
            runner.run()
    order = np.random.default_rng(0)
    for _ in range(rounds):
        for index in order.permutation(len(runners)):
            runners[index].times.append(runners[index].run())


class TimedSteps:
    """A runner whose :meth:`run` times ``steps`` calls of its ``step`` on its ``state`` and
    ``batch`` (the state carried on), for :func:`time_interleaved`."""

    steps = 3

    def run(self) -> float:
        """The mean seconds of one step."""
        import time

        import jax

        start = time.perf_counter()
        for _ in range(self.steps):
            self.state, metrics = self.step(self.state, self.batch)
        jax.block_until_ready(metrics)
        return (time.perf_counter() - start) / self.steps


def write_results(out: str, name: str, meta: dict, results: list, text: str) -> None:
    """``out/name.json`` (the meta and every figure) and ``out/name.md`` (the table)."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(text)


def published(description: str, name: str, runs: Sequence, predict: Callable, markdown: Callable,
              meta: dict) -> None:
    """The command line of a benchmark that plans runs someone published (``runs``, each with a ``name``):
    ``--runs`` picks them by name, each ``predict(run)`` is printed as it ends, then ``markdown(results)``;
    ``--out`` writes ``name.{json,md}`` (:func:`write_results`), ``--from-json`` renders such a file again."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", default=None, help=f"write {name}.{{json,md}} here")
    parser.add_argument("--runs", default=",".join(run.name for run in runs))
    parser.add_argument("--from-json", default=None, help=f"render a {name}.json again, planning nothing")
    args = parser.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            print(markdown(json.load(f)["results"]))
        return
    results = []
    for run in (run for run in runs if run.name in args.runs.split(",")):
        results.append(predict(run))
        print(json.dumps(results[-1], default=str), flush=True)
    text = markdown(results)
    print(text)
    if args.out:
        write_results(args.out, name, meta, results, text)


def report(args: argparse.Namespace, name: str, results: list, markdown, **meta) -> None:
    """The run's meta (devices, platform, JAX version, rounds, then ``meta``), its table
    (``markdown(results, meta)``) printed, and unless ``--smoke``, ``out/name.{json,md}``."""
    import jax

    meta = {"devices": jax.device_count(), "platform": jax.devices()[0].platform, "jax": jax.__version__,
            "rounds": args.rounds, **meta}
    text = markdown(results, meta)
    print(text)
    if not args.smoke:
        write_results(args.out, name, meta, results, text)
