"""``px.plan(hardware=...)`` from this CPU against training runs someone else published.

    python -m benchmarks.published_runs --out benchmarks/results      # about 10 minutes on two cores
    python -m benchmarks.published_runs --listed --out benchmarks/results   # the blocks kept in a list

torchtitan's Llama 3.1 runs on H100s (``benchmarks/llama3_h100_202412_torchtitan.md`` in
pytorch/torchtitan, December 2024: 8 to 512 GPUs, FSDP, TP, PP, sequence 8192, their tokens per
second per GPU and memory), planned here as a user would before renting the GPUs: the same shapes
written in Flax (:mod:`benchmarks.llama`, a scanned stack, bf16 compute over float32 params and
AdamW, attention by jax's Pallas flash-attention kernel as theirs is a flash attention; ``--attention
chunked``: plain JAX a chunk of queries at a time), the same layout, global
batch and sequence, on their hardware as they describe it (H100 with 96 GB HBM2e at 2.4 TB/s, a
500 W limit, 400 Gb/s per GPU between hosts; the peak FLOP/s are the SXM data sheet's, as their
MFU figures use). Nothing is fitted to their numbers.

What differs, and which way it moves the comparison (said again in the results): the 8B runs keep
what their selective checkpointing keeps (every other matmul's output and the attention's), but
the kernel's forward runs again in the backward for its log-sum-exp, which theirs keeps; their 70B
and 405B runs are float8 with torch.compile (faster than the bf16 predicted here); their pipeline
schedule is 1F1B (interleaved 1F1B), parallax's GPipe with its own microbatch count (another
bubble and another activation memory); their memory is the most their caching allocator reserved,
the plan's the peak of XLA's GPU program (compiled here without a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SOURCE = ("https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md "
          "(torchtitan 9dec370, torch 1963fc8, 2024-12)")
SEQUENCE = 8192
CHUNK = 1024  # queries per attention chunk


class Run(NamedTuple):
    name: str
    model: str
    devices: int
    layout: str  # parts, as px.combine takes them (see strategy())
    global_batch: int
    published_tps: float  # tokens per second per GPU
    published_gib: float
    their_setup: str
    selective: bool = False  # their selective (op) activation checkpointing, else full


RUNS = (
    Run("8b-fsdp8", "8b", 8, "fsdp8", 16, 5_762, 82.4, "Table 1: FSDP, eager, bf16, selective AC, local batch 2", True),
    Run("8b-fsdp128", "8b", 128, "fsdp128", 256, 5_605, 67.0, "Table 3: FSDP, eager, bf16, selective AC, local batch 2",
        True),
    Run("70b-fsdp32-tp8", "70b", 256, "fsdp32+tp8", 512, 829, 71.9,
        "Table 4: FSDP 32 × TP 8, torch.compile + float8, full AC, local batch 16"),
    Run("405b-pp8-fsdp8-tp8", "405b", 512, "pp8+fsdp8+tp8", 256, 100, 82.5,
        "Table 5: PP 8 × FSDP 8 × TP 8, 1F1B, torch.compile + float8 + async TP, full AC, local batch 32"),
)


def hardware():
    """torchtitan's H100s as their document describes them."""
    import parallax as px

    return px.Hardware("h100", memory_gib=96, memory_tbps=2.4, inter_host_gbps=400)


def strategy(layout: str):
    import parallax as px

    parts = {"fsdp": px.FSDP, "tp": px.TensorParallel, "pp": px.PipelineParallel}
    built = []
    for part in layout.split("+"):
        kind = part.rstrip("0123456789")
        built.append(parts[kind](int(part[len(kind):])))
    return built[0] if len(built) == 1 else px.combine(*built)


def predict(run: Run, auto: bool = False, listed: bool = False, memory_budget: str | None = None,
            attention: str = "flash") -> dict:
    import optax

    import parallax as px
    from benchmarks.llama import SHAPES, TORCHTITAN_SELECTIVE, ListedLlama, Llama, batch, loss_fn

    shape = SHAPES[run.model]._replace(chunk=CHUNK, flash="gpu" if attention == "flash" else "",
                                       saved=TORCHTITAN_SELECTIVE if run.selective else ())
    model = (ListedLlama if listed else Llama)(shape)
    def planned(strategies: list) -> tuple:
        start = time.perf_counter()
        report = px.plan(model, optax.adamw(3e-4), batch(run.global_batch, SEQUENCE), loss_fn=loss_fn,
                         strategies=strategies, devices=run.devices, hardware=hardware(), compile="jit",
                         memory_budget=memory_budget)
        return report, time.perf_counter() - start

    start = time.perf_counter()
    try:
        report, seconds = planned([strategy(run.layout)])
        searched, search_seconds = planned(["auto"]) if auto else (None, None)
    except RuntimeError as err:  # the planning subprocess died: recorded, the other runs still planned
        return {"run": run._asdict(), "attention": attention, "plan_seconds": time.perf_counter() - start,
                "peak": None, "fits": None,
                "note": None, "error": str(err).splitlines()[0], "step": {}, "predicted_tps": None, "mesh": None,
                "backend": None}
    row = report.rows[0]
    step = row.get("step") or {}
    picked = searched.picks[0] if searched is not None else None
    return {"run": run._asdict(), "attention": attention, "plan_seconds": seconds, "peak": row.get("peak"),
            "fits": report.fits(row), "note": row.get("note"), "error": row.get("error"), "step": step,
            "predicted_tps": step.get("tokens_per_second"), "mesh": row.get("mesh"), "backend": row.get("backend"),
            "auto": None if picked is None else {
                "pick": picked.describe(), "strategy": picked.strategy, "seconds": picked.seconds,
                "runner_up": picked.runner_up, "candidates": picked.planned, "fitting": picked.fitting,
                "pruned": picked.pruned, "search_seconds": search_seconds,
                "compiled": sum(not r.get("error") for r in searched.rows),
                "peak": next((r["peak"] for r in searched.rows if r["strategy"] == picked.strategy), None)}}


COMPILED_FOR = {"gpu": "GPU (deviceless)", "cpu": "CPU"}


def markdown(results: list[dict], listed: bool = False) -> str:
    gib = 2**30
    written = ("`ListedLlama`, its blocks kept in a list of `nn.remat` blocks as Hugging Face writes them" if listed
               else "scanned")
    flash = all(r.get("attention", "chunked") == "flash" for r in results)
    attention = ("attention by jax's Pallas flash-attention kernel for GPUs, per device in a `shard_map`" if flash
                 else f"attention {CHUNK} queries at a time in plain JAX")
    lines = ["## px.plan on this CPU against torchtitan's published H100 runs", "",
             f"Source: {SOURCE}. Hardware: `px.Hardware(\"h100\", memory_gib=96, memory_tbps=2.4, "
             f"inter_host_gbps=400)`; sequence 8192; the model `benchmarks/llama.py` ({written}, bf16, {attention}; "
             "recomputed as they do: the 8B runs keep what torchtitan's selective checkpointing keeps "
             "(`benchmarks.llama.TORCHTITAN_SELECTIVE`), the others recompute every block).", "",
             "| run | their setup | step published | step predicted | compute + memory + exposed | published / compute "
             "| tok/s/GPU published | predicted | memory published | peak planned | compiled for | plan time |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        run, step = r["run"], r["step"]
        tokens = run["global_batch"] * SEQUENCE / run["devices"]  # per GPU and step
        published = tokens / run["published_tps"]
        if not step:
            why = r["error"] or "no step"
            lines.append(f"| {run['name']} | {run['their_setup']} | {published:.2f} s | not planned: {why} | - | - | "
                         f"{run['published_tps']:,} | - | {run['published_gib']} GiB | - | - "
                         f"| {r['plan_seconds']:.0f} s |")
            continue
        lines.append(
            f"| {run['name']} | {run['their_setup']} | {published:.2f} s | {step['seconds']:.2f} s "
            f"| {step['compute']:.2f} + {step['memory']:.2f} + {step['exposed']:.2f} s "
            f"| {published / step['compute']:.2f} | {run['published_tps']:,} | {r['predicted_tps']:,.0f} "
            f"| {run['published_gib']} GiB | {r['peak'] / gib:.1f} GiB "
            f"| {COMPILED_FOR.get(r.get('backend'), r.get('backend'))} | {r['plan_seconds']:.0f} s |")
    lines += ["", "Step published: their tokens per GPU and step over their tokens per second per GPU. Step predicted: "
              "the compiled program's FLOPs (recomputation and the pipeline's bubble included) at the data sheet's "
              "dense bf16 peak (989 TFLOP/s, their MFU's) + its bytes at the memory bandwidth + the collectives on the "
              "critical path, nothing fitted. Published / compute: how many times the FLOPs at the peak their step "
              "took (the reciprocal of an MFU that counts the recomputation). "
              + ("The attention kernel is priced by its own loads, stores and matmuls over its grid "
                 "(`parallax/pricing/kernel_cost.py`). " if flash else
                 "The memory term is this model's attention as written in plain JAX, whose score tiles XLA writes to "
                 "memory; their flash attention keeps them on chip, which is most of the difference where the memory "
                 "term leads. ") + "Peak planned: XLA's GPU "
              "compiler's program for H100s, compiled here without them (with JAX's CUDA plugin; else the CPU "
              "compiler's, an overestimate), not PyTorch's allocator's (theirs is the most the caching allocator "
              "reserved, fragmentation included): theirs shards the residual stream over the tensor axis "
              "(sequence parallelism) and keeps float8 copies in the 70B and 405B ones."]
    return "\n".join(lines) + "\n"


def auto_markdown(results: list[dict]) -> str:
    """``strategies=["auto"]`` beside each run's published layout: its pick, predicted on the same hardware."""
    gib = 2**30
    lines = ["", "## strategy='auto' beside their layout", "",
             "| run | their layout, predicted | auto's pick, predicted | its peak (planned) | runner-up | "
             "candidates (compiled, fitting) | search time |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        auto, run, step = r.get("auto"), r["run"], r["step"]
        if not auto:
            continue
        theirs = f"{run['layout']}, {step['seconds']:.2f} s" if step else f"{run['layout']}, not planned"
        counts = f"{auto['candidates']} ({auto.get('compiled', '?')}, {auto['fitting']})"
        took = f"{auto['search_seconds']:.0f} s" if auto.get("search_seconds") is not None else "-"
        if auto["strategy"] is None:
            lines.append(f"| {run['name']} | {theirs} | nothing fits | - | - | {counts} | {took} |")
            continue
        runner = (f"{auto['runner_up'][0]}, {auto['runner_up'][1]:.2f} s" if auto["runner_up"] else "-")
        lines.append(f"| {run['name']} | {theirs} | {auto['strategy']}, {auto['seconds']:.2f} s | "
                     f"{auto['peak'] / gib:.1f} GiB | {runner} | {counts} | {took} |")
    lines += ["", "Search time: `px.plan(strategies=[\"auto\"], hardware=...)` alone, on this 2-core machine. "
              "Candidates: the meshes `\"auto\"` prices on that many devices that apply; compiled: those not pruned "
              "before compiling (a state alone over the 96 GiB, or a step whose lower bound from its jaxpr is no less "
              "than the runner-up's prediction); fitting: the compiled ones whose planned peak fits 96 GiB."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write published_runs.{json,md} here")
    parser.add_argument("--runs", default=",".join(run.name for run in RUNS))
    parser.add_argument("--from-json", default=None, help="render a published_runs.json again, planning nothing")
    parser.add_argument("--auto", action="store_true", help="also plan strategies=['auto'] for each run: its pick "
                        "against their layout (written to published_auto.{json,md})")
    parser.add_argument("--listed", action="store_true", help="the model's blocks kept in a list, as Hugging Face "
                        "writes them (benchmarks.llama.ListedLlama; written to published_listed.{json,md})")
    parser.add_argument("--attention", choices=("flash", "chunked"), default="flash",
                        help="the model's attention: jax's Pallas flash-attention kernel (as their runs' flash "
                        "attention), or plain JAX a chunk of queries at a time (written to published_*_chunked.*)")
    parser.add_argument("--memory-budget", default=None, help="bytes per device a plan must fit (e.g. 10TB: a run that "
                        "does not fit the H100's 96 GiB is then not searched for a fix, planned once)")
    args = parser.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            print(markdown(json.load(f), args.listed))
        return
    chosen = [run for run in RUNS if run.name in args.runs.split(",")]
    results = []
    for run in chosen:
        results.append(predict(run, args.auto, args.listed, args.memory_budget, args.attention))
        print(json.dumps({k: v for k, v in results[-1].items() if k != "note"}, default=str), flush=True)
    text = markdown(results, args.listed) + (auto_markdown(results) if args.auto else "")
    print(text)
    if args.out:
        name = {(False, False): "published_runs", (True, False): "published_auto", (False, True): "published_listed",
                (True, True): "published_listed_auto"}[args.auto, args.listed]
        name += "_chunked" if args.attention == "chunked" else ""
        with open(os.path.join(args.out, f"{name}.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
        with open(os.path.join(args.out, f"{name}.md"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
