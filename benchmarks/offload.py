"""Bigger than the devices: the largest transformer LM that fits a per-device budget, by option.

    python -m benchmarks.offload                      # 8 simulated CPU devices, FSDP, AdamW
    python -m benchmarks.offload --regimes state --budget 128MiB --rounds 5
    python -m benchmarks.offload --smoke              # a tiny model, one round: checks it still runs

For the benchmark transformer LM (``benchmarks/models.py``: width features, width / 64 heads,
vocabulary 512) in two regimes (``REGIMES``: width 256 with 16 sequences of 64 tokens per step,
where the state and the gathered weights fill the devices; width 128 with 32 sequences of 256
tokens, where the activations do) under FSDP with AdamW on 8 devices, each option is given the
largest layer count whose compiled train step peaks within ``--budget`` per device, by the step's
own ``memory_analysis()`` (device memory; the state offloaded to host memory apart, see
:func:`parallax.inspect.memory_bytes`): exact bytes, no run needed. The options:

* ``none``: all state on the devices;
* ``offload='optimizer'``: the AdamW moments in host memory;
* ``offload='optimizer+params'``: the params (the float32 master copy) too;
* ``remat=('Block', policy)`` for the policies ``nothing`` (recompute each block), ``dots``,
  ``dots_no_batch`` and ``offload_dots`` (:data:`parallax.models.remat_policy.NAMED_POLICIES`).

The peak is affine in the layer count, so two compiles give the slope and a few more find the
exact boundary. Then each option's step time is measured on one model that fits them all (the
largest ``none`` fits), in interleaved rounds, as a ratio to ``none`` in the same round
(median, min-max). Results go to ``benchmarks/results/offload.{json,md}``.

The published results were measured with jax 0.12 (``.venv-latest``): jax 0.10.2's XLA:CPU
schedules a rematerialised block's recomputation early and keeps as much as without remat (the
temporaries are unchanged), so there remat saves nothing on this backend.

On the CPU backend the devices and the host share one memory: the transfers cost a copy, not a
PCIe trip, and XLA:CPU keeps an ``offload_dots`` activation where ``dots`` keeps it (it has no
separate host memory space for temporaries), so that policy's saving shows only on a GPU or TPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import RESULTS, simulate_cpu_devices, write_results

POLICIES = ("nothing", "dots", "dots_no_batch", "offload_dots")
# Two regimes: short sequences, where the state and the gathered weights fill the devices, and
# long ones, where the activations do. Each option pays where its part of the memory dominates.
REGIMES = {"state": {"width": 256, "seq": 64, "batch": 16}, "activations": {"width": 128, "seq": 256, "batch": 32}}
SMOKE = {"width": 64, "seq": 16, "batch": 8}


def options_grid() -> dict[str, dict]:
    from parallax.models.remat_policy import named_policy

    grid = {"none": {}, "offload='optimizer'": {"offload": "optimizer"},
            "offload='optimizer+params'": {"offload": "optimizer+params"}}
    for policy in POLICIES:
        grid[f"remat=('Block', {policy})"] = {"remat": ("Block", named_policy(policy))}
    return grid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="64MiB", help="device memory per device")
    parser.add_argument("--regimes", default=",".join(REGIMES), help=f"comma-separated, of {sorted(REGIMES)}")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="steps per timed run")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args()
    regimes = {"smoke": SMOKE} if args.smoke else {name: REGIMES[name] for name in args.regimes.split(",") if name}
    if args.smoke:
        args.budget, args.rounds, args.steps = "1MiB", 1, 2
    simulate_cpu_devices(args.devices)
    import jax

    results, text = [], ("# Bigger than the devices: offload and remat policies (`python -m benchmarks.offload`)\n\n"
                          "Exact bytes from each compiled step's `memory_analysis()`; step times on this machine.\n\n")
    for name, shape in regimes.items():
        rows, table = run_regime(name, args, **shape)
        results += rows
        text += table + "\n"
    print(text)
    meta = {"budget_label": args.budget, "devices": args.devices, "rounds": args.rounds, "steps": args.steps,
            "regimes": regimes, "strategy": "FSDP(min_weight_size=0)", "optimizer": "adamw",
            "backend": jax.default_backend(), "jax": jax.__version__}
    if not args.smoke:
        write_results(args.out, "offload", meta, results, text)


def run_regime(regime: str, args: argparse.Namespace, width: int, seq: int, batch: int) -> tuple[list[dict], str]:
    """Each option's largest model and step-time cost in one regime: JSON rows and a markdown table."""
    import jax
    import numpy as np
    import optax

    import parallax as px
    from benchmarks.models import TransformerLM, lm_loss
    from parallax import inspect
    from parallax._units import format_bytes, parse_bytes

    budget = parse_bytes(args.budget)
    heads = max(1, width // 64)
    rng = np.random.default_rng(0)
    example = {"x": rng.integers(0, 512, (batch, seq + 1)).astype(np.int32)}
    strategy = px.FSDP(min_weight_size=0)
    optimizer = optax.adamw(1e-3)

    def model(layers):
        return TransformerLM(features=width, layers=layers, heads=heads)

    def compiled_peak(layers: int, options: dict) -> tuple[int, int, int]:
        """Device peak, host bytes and param count of the step compiled for ``layers`` layers."""
        step_options = px.StepOptions(compile="jit", **options)
        plan = px.plan_state(model(layers), optimizer, example, strategy=strategy, loss_fn=lm_loss,
                             offload=step_options.offload)
        step = px.make_train_step(lm_loss, strategy, step_options)
        memory = inspect.memory_bytes(step.lower(plan.abstract_arrays(), example).compile())
        return inspect.peak_bytes(memory), memory["host"], px.summarize(plan).totals["params"]["count"]

    def largest(options: dict) -> dict:
        """The most layers that fit, found from the peak's slope and checked by compiling."""
        peaks = {layers: compiled_peak(layers, options) for layers in (1, 2)}
        slope = max(1, peaks[2][0] - peaks[1][0])
        guess = max(1, 1 + (budget - peaks[1][0]) // slope)
        while True:  # step to the exact boundary from the affine guess
            peaks.setdefault(guess, compiled_peak(guess, options))
            if peaks[guess][0] > budget:
                if guess == 1:
                    return {"layers": 0, "params": 0, "peak": peaks[1][0], "host": peaks[1][1]}
                guess -= 1
                continue
            peaks.setdefault(guess + 1, compiled_peak(guess + 1, options))
            if peaks[guess + 1][0] > budget:
                peak, host, params = peaks[guess]
                return {"layers": guess, "params": params, "peak": peak, "host": host,
                        "per_layer": slope, "compiles": len(peaks)}
            guess += 1

    grid = options_grid()
    fits = {}
    for label, options in grid.items():
        start = time.perf_counter()
        fits[label] = largest(options)
        print(f"{regime}, {label}: {fits[label]['layers']} layers, {fits[label]['params']:,} params, peak "
              f"{format_bytes(fits[label]['peak'])} + {format_bytes(fits[label]['host'])} host "
              f"({time.perf_counter() - start:.0f} s)", flush=True)

    # Step time of each option on one model that fits them all.
    layers = max(1, fits["none"]["layers"])
    data = [example] * args.steps
    runs = {}
    for label, options in grid.items():
        step_options = px.StepOptions(compile="jit", **options)
        state = px.init_state(model(layers), optimizer, example, strategy=strategy, loss_fn=lm_loss,
                              options=step_options)
        step = px.make_train_step(lm_loss, strategy, step_options)
        state, metrics = step(state, example)  # compile
        jax.block_until_ready(metrics["loss"])
        runs[label] = [step, state, []]
    order = np.random.default_rng(0)
    for _ in range(args.rounds):
        for index in order.permutation(len(runs)):
            label = list(runs)[index]
            step, state, times = runs[label]
            start = time.perf_counter()
            for b in data:
                state, metrics = step(state, b)
            jax.block_until_ready(metrics["loss"])
            runs[label][1] = state
            times.append((time.perf_counter() - start) / len(data))
    results = []
    base = np.array(runs["none"][2])
    for label in grid:
        times = np.array(runs[label][2])
        ratio = times / base
        results.append({"regime": regime, "width": width, "seq": seq, "batch": batch, "option": label,
                        **fits[label], "timed_layers": layers,
                        "step_ms": {"median": 1e3 * float(np.median(times)), "min": 1e3 * float(times.min()),
                                    "max": 1e3 * float(times.max())},
                        "ratio_to_none": {"median": float(np.median(ratio)), "min": float(ratio.min()),
                                          "max": float(ratio.max())}})
    lines = [f"## {regime}: the largest transformer LM within {args.budget} per device, {args.devices} "
             f"{jax.default_backend()} devices, FSDP, AdamW",
             "",
             f"Width {width}, {heads} heads, vocabulary 512, {seq} tokens x {batch} sequences per "
             f"step. Layers and peak from the compiled step's `memory_analysis()` (device memory; host memory "
             f"apart). Step time on {layers} layers (the largest that fits with all state on the devices), "
             f"{args.rounds} interleaved rounds of {args.steps} steps; ratio to `none` in the same round, "
             "median (min-max).",
             "",
             "| option | layers | params | device peak | host | step ms | x none |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for row in results:
        r, t = row["ratio_to_none"], row["step_ms"]
        lines.append(f"| `{row['option']}` | {row['layers']} | {row['params']:,} | {format_bytes(row['peak'])} | "
                     f"{format_bytes(row['host'])} | {t['median']:.0f} | {r['median']:.2f} ({r['min']:.2f}-"
                     f"{r['max']:.2f}) |")
    return results, "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
