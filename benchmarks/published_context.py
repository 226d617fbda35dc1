"""``px.plan(hardware=...)`` from this CPU against torchtitan's context-parallel runs.

    python -m benchmarks.published_context --out benchmarks/results   # about 5 minutes on two cores

torchtitan's Table 2 (``benchmarks/llama3_h100_202412_torchtitan.md`` in pytorch/torchtitan, December
2024): Llama 3.1 8B on 8 H100s, one sequence per FSDP rank, the sequence doubled with each doubling of
the context axis (32,768 tokens under FSDP 8 to 262,144 under CP 8), full activation checkpointing,
torch.compile and float8. Planned here as a user would before renting the GPUs: the same shapes in Flax
(:mod:`benchmarks.llama`, a scanned stack, bf16 compute over float32 params, AdamW, every block
recomputed), the same layout, batch and sequence, on their hardware as they describe it
(:func:`benchmarks.published_runs.hardware`). Without a context split (their first row) the attention is
jax's Pallas flash-attention kernel, as theirs is a flash attention; with one, it is the attention as
plain JAX writes it (``flax.linen.dot_product_attention`` under a causal mask), which parallax's
``ContextParallel(size, "ring", load_balance=True, shard_params=True)`` splits (a Pallas kernel is opaque
to it), the state split over the context devices too, as torchtitan's FSDP splits it over its data and
context devices. Nothing is fitted to their numbers.
"""

from __future__ import annotations

import os
import sys
import time
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.published_runs import COMPILED_FOR, SOURCE, hardware


class ContextRun(NamedTuple):
    context: int  # the context axis; FSDP takes the other devices of 8
    sequence: int
    published_tps: float  # tokens per second per GPU
    published_gib: float

    @property
    def name(self) -> str:
        return f"8b-fsdp{8 // self.context}-cp{self.context}"

    @property
    def global_batch(self) -> int:
        return 8 // self.context  # one sequence per FSDP rank ("local batch size 1")


RUNS = (ContextRun(1, 32_768, 3_890, 83.9), ContextRun(2, 65_536, 2_540, 84.2), ContextRun(4, 131_072, 1_071, 84.0),
        ContextRun(8, 262_144, 548, 84.5))
THEIR_SETUP = "Table 2: FSDP + CP, torch.compile + float8, full AC, local batch 1"


def strategy(run: ContextRun):
    import parallax as px

    fsdp = px.FSDP(8 // run.context)
    if run.context == 1:
        return fsdp
    return px.combine(px.ContextParallel(run.context, "ring", load_balance=True, shard_params=True), fsdp)


def predict(run: ContextRun) -> dict:
    import optax

    import parallax as px
    from benchmarks.llama import SHAPES, Llama, batch, loss_fn

    shape = SHAPES["8b"]._replace(flash="gpu" if run.context == 1 else "")
    start = time.perf_counter()
    try:
        report = px.plan(Llama(shape), optax.adamw(3e-4), batch(run.global_batch, run.sequence), loss_fn=loss_fn,
                         strategies=[strategy(run)], devices=8, hardware=hardware(), compile="jit")
    except RuntimeError as err:  # the planning subprocess died: recorded, the other runs still planned
        return {"run": {**run._asdict(), "name": run.name}, "plan_seconds": time.perf_counter() - start,
                "error": str(err).splitlines()[0], "step": {}, "peak": None}
    row = report.rows[0]
    return {"run": {**run._asdict(), "name": run.name}, "plan_seconds": time.perf_counter() - start,
            "attention": "flash" if run.context == 1 else "plain", "strategy": row.get("strategy"),
            "peak": row.get("peak"), "fits": report.fits(row), "error": row.get("error"), "step": row.get("step") or {},
            "backend": row.get("backend")}


def markdown(results: list[dict]) -> str:
    gib = 2**30
    lines = ["## px.plan on this CPU against torchtitan's context-parallel H100 runs", "",
             f"Source: {SOURCE}, {THEIR_SETUP}. Hardware and model as `benchmarks/published_runs.py` plans them; "
             "every block recomputed.", "",
             "| run | attention | step published | step predicted | compute + memory + exposed | published / compute "
             "| tok/s/GPU published | predicted | memory published | peak planned | compiled for | plan time |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        run, step = r["run"], r["step"]
        published = run["sequence"] * (8 // run["context"]) / 8 / run["published_tps"]  # their step, seconds
        attention = {"flash": "Pallas flash kernel", "plain": "plain JAX, split by CP"}.get(r.get("attention"), "-")
        if not step:
            lines.append(f"| {run['name']} | {attention} | {published:.2f} s | not planned: {r.get('error')} | - | - "
                         f"| {run['published_tps']:,} | - | {run['published_gib']} GiB | - | - "
                         f"| {r['plan_seconds']:.0f} s |")
            continue
        lines.append(
            f"| {run['name']} | {attention} | {published:.2f} s | {step['seconds']:.2f} s "
            f"| {step['compute']:.2f} + {step['memory']:.2f} + {step['exposed']:.2f} s "
            f"| {published / step['compute']:.2f} | {run['published_tps']:,} | {step['tokens_per_second']:,.0f} "
            f"| {run['published_gib']} GiB | {r['peak'] / gib:.1f} GiB "
            f"| {COMPILED_FOR.get(r.get('backend'), r.get('backend'))} | {r['plan_seconds']:.0f} s |")
    lines += ["", "Step published: their tokens per GPU and step over their tokens per second per GPU. Step "
              "predicted as in `published_runs.md`: the program's FLOPs at the dense bf16 peak + its bytes at the "
              "memory bandwidth + the collectives on the critical path. With a context split the attention is "
              "plain JAX: XLA writes each tile's scores, exponentials and their gradients to memory, which the "
              "memory term is; their flash attention keeps them on chip. Published / compute: how many times the "
              "FLOPs at the peak their step took (theirs are float8 matmuls, faster than the bf16 peak)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    from benchmarks import published

    published(__doc__.splitlines()[0], "published_context", RUNS, predict, markdown,
              {"source": SOURCE, "their_setup": THEIR_SETUP})


if __name__ == "__main__":
    main()
