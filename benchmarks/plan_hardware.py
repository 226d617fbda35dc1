"""``px.plan(hardware=...)`` from this CPU against steps measured on the accelerator itself.

    python -m benchmarks.plan_hardware --out benchmarks/results     # about 2 minutes on two cores

Plans, on this machine's CPU, the configurations ``benchmarks/gpu.py`` measured on an NVIDIA
H200 (``results/gpu.json`` and, measured later, ``results/gpu_new.json``: the transformer LM under
several options and shapes, and a Llama-shaped stack), with ``hardware="h200"``, as a user without
the GPU would, and prints the predicted step time, MFU and peak beside the measured ones. With
JAX's CUDA plugin installed (``pip install 'parallax-flax[gpu]'``) the step is compiled by XLA's GPU
compiler for an H200 without one, and the peak is that compiler's; without it, the CPU compiler's
(an estimate). Nothing is tuned to these runs: the hardware is the data sheet's
(``px.Hardware("h200")``), the step's FLOPs the compiled program's and its bytes read from its
jaxpr as a GPU compiler fuses them (:mod:`parallax.pricing.fused_bytes`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
COMPILED_FOR = {"gpu": "GPU (deviceless)", "cpu": "CPU"}
CONFIGS = ("fp32", "bf16", "bf16+remat", "bf16+offload", "fp32+remat", "bf16+accum4", "bf16 wide", "llama bf16")


def measured(recorded: dict) -> dict[str, dict]:
    """Per configuration: the measured step seconds (median of the interleaved rounds where the speed
    run has it, else the memory run's) and the allocator's peak bytes."""
    out = {entry["config"]: {"peak": entry["measured"]["peak_bytes_in_use"], "step_s": entry["measured"].get("step_s")}
           for entry in recorded["memory"] if "after the fix" not in entry["config"]}
    for entry in recorded.get("measured", ()):  # gpu_new.json: one configuration a process, one at a time
        out[entry["config"]] = {"peak": entry["peak_bytes_in_use"], "step_s": entry["step_s"]}
    for run in recorded.get("speed", {}).get("runs", ()):
        out.setdefault(run["precision"], {})["step_s"] = statistics.median(run["parallax_s"])
    return out


def predict(config: str, hardware: str = "h200") -> dict:
    """``px.plan``'s row for one configuration of ``benchmarks/gpu.py`` on one ``hardware`` device."""
    import jax
    import optax

    import parallax as px
    from benchmarks.gpu import MEMORY_CONFIGS, build

    model, loss_fn, example, _, _ = build(False, config)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), example)
    report = px.plan(model, optax.adamw(3e-4), shapes, loss_fn=loss_fn, strategies=["dp"], devices=[1],
                     hardware=hardware, compile="jit", **MEMORY_CONFIGS[config])
    return report.rows[0]


def measured_all(recorded_path: str = os.path.join(RESULTS, "gpu.json")) -> dict[str, dict]:
    """:func:`measured` of ``gpu.json`` and of ``gpu_new.json`` beside it (measured later, on a quiet
    device: its steps where gpu.json's memory run had none)."""
    with open(recorded_path) as f:
        truth = measured(json.load(f))
    later = os.path.join(os.path.dirname(recorded_path), "gpu_new.json")
    if os.path.exists(later):
        with open(later) as f:
            for config, found in measured({"memory": [], **json.load(f)}).items():
                truth[config] = {**found, **{k: v for k, v in truth.get(config, {}).items() if v}}
    return truth


def compare(configs=CONFIGS, recorded_path: str = os.path.join(RESULTS, "gpu.json")) -> list[dict]:
    truth = measured_all(recorded_path)
    rows = []
    for config in configs:
        start = time.perf_counter()
        row = predict(config)
        step = row["step"]
        real = truth.get(config, {})
        rows.append({"config": config, "predicted_s": step["seconds"], "measured_s": real.get("step_s"),
                     "compute_s": step["compute"], "memory_s": step["memory"], "offload_s": step["offload"],
                     "predicted_mfu": step["mfu"],
                     "measured_mfu": ((step["flops"] / real["step_s"] / step["peak_flops"]) if real.get("step_s")
                                      else None),
                     "predicted_peak": row["peak"], "measured_peak": real.get("peak"), "source": step["source"],
                     "compiled_for": row["backend"],
                     "plan_seconds": time.perf_counter() - start})
    return rows


def _error(predicted, measured_value) -> str:
    return "-" if not measured_value else f"{100 * (predicted / measured_value - 1):+.1f}%"


def same_stack_lines(path: str = os.path.join(RESULTS, "gpu_new.json")) -> list[str]:
    """What the same deviceless compile gave on the GPU's machine, with its jax: a gap here that is the
    two jax versions' compilers, not the deviceless compile."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        recorded = json.load(f)
    peaks = {m["config"]: m["peak_bytes_in_use"] for m in recorded.get("measured", ())}
    return [f"- {r['config']}: compiled deviceless for the H200 on the GPU's machine (jax {r['jax']}, as the run): "
            f"{r['peak']:,} B against the allocator's {peaks[r['config']]:,} B "
            f"({_error(r['peak'], peaks[r['config']])})."
            for r in recorded.get("deviceless_on_the_gpu_machine", ()) if r["config"] in peaks]


def markdown(rows: list[dict], device: str) -> str:
    lines = [f"## px.plan(hardware=\"h200\") on this CPU against {device}", "",
             "| configuration | step measured | step predicted | error | compute + memory + offload | MFU measured "
             "| MFU predicted | peak measured | peak planned | compiled for | error |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    gib = 2**30
    for r in rows:
        step = "-" if not r["measured_s"] else f"{r['measured_s']:.4f} s"
        mfu = "-" if r["measured_mfu"] is None else f"{100 * r['measured_mfu']:.1f}%"
        lines.append(
            f"| {r['config']} | {step} | {r['predicted_s']:.4f} s | {_error(r['predicted_s'], r['measured_s'])} "
            f"| {r['compute_s']:.4f} + {r['memory_s']:.4f} + {r['offload_s']:.4f} | {mfu} "
            f"| {100 * r['predicted_mfu']:.1f}% | {r['measured_peak'] / gib:.2f} GiB "
            f"| {r['predicted_peak'] / gib:.2f} GiB | {COMPILED_FOR.get(r['compiled_for'], r['compiled_for'])} "
            f"| {_error(r['predicted_peak'], r['measured_peak'])} |")
    lines += ["", "Step: the compiled program's FLOPs at the data sheet's dense peak (TF32 494 TFLOP/s for float32, "
              "bf16 989) + its bytes, read from the jaxpr as a GPU compiler fuses them, at 4.8 TB/s + offloaded "
              "state over PCIe; nothing fitted to these runs. Peak: XLA's GPU compiler's for an H200 without the "
              "GPU (jax-cuda12-plugin; no autotuning), or where it is not installed the CPU compiler's, which fuses "
              "less (an estimate). fp32, bf16: the interleaved speed runs of gpu.json; the others one process at a "
              "time (gpu_new.json), planned here before they ran (gpu_new_predicted.json)."]
    same = same_stack_lines()
    if same:
        lines += ["", "Planned here with this machine's jax; the runs used the GPU's (gpu.json's meta). The same "
                  "deviceless compile there:", "", *same]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write plan_hardware.{json,md} here")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    rows = compare(args.configs.split(","))
    with open(os.path.join(RESULTS, "gpu.json")) as f:
        device = json.load(f)["meta"]["device"]
    text = markdown(rows, device)
    print(text)
    if args.out:
        with open(os.path.join(args.out, "plan_hardware.json"), "w") as f:
            json.dump({"device": device, "rows": rows}, f, indent=1)
        with open(os.path.join(args.out, "plan_hardware.md"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
