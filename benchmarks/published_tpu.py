"""``px.plan(hardware="v6e")`` from this CPU, compiled by the TPU compiler, against MaxText's published TPU runs.

    python -m benchmarks.published_tpu --out benchmarks/results   # about 5 minutes on two cores (libtpu)

MaxText's Llama 3.1 runs on Trillium (TPU v6e), as the tpu-recipes READMEs publish them
(AI-Hypercomputer/tpu-recipes, ``training/trillium/Llama3.1-8B-MaxText`` for v6e-8 and v6e-256 and
``training/trillium/Llama3.1-70B-MaxText``): the step seconds, TFLOP/s and tokens per second per chip
their logs print, with the configuration each README gives (``per_device_batch_size``, FSDP over every
chip, sequence 8192, splash attention, ``remat_policy: custom`` offloading the block's input and the
attention's projections to the host). Planned here as a user would plan them: the same shapes written in
Flax (:mod:`benchmarks.llama`, a scanned stack, bf16 over float32 params, AdamW), FSDP over the same
chips, attention by jax's Pallas flash-attention kernel for TPUs, each block offloading to the host what
theirs offloads (``jax.checkpoint_policies.save_and_offload_only_these_names``), the loss as
``logsumexp`` minus the label's logit (:func:`benchmarks.llama.lean_loss_fn`: with optax's cross entropy,
whose float32 log-probabilities over the vocabulary stay for the backward, the TPU compiler refuses the
8B on 8 chips and the 70B: 42.5 and 40.3 GiB), on ``px.Hardware("v6e")``, compiled by the TPU compiler
for the slice without one (``libtpu``, the ``tpu`` extra). Nothing is fitted.

What differs: their splash attention's blocks (2,048) and fused backward against the flash kernel's
(1,024); their XLA flags (collective matmul, overlap, SparseCore offloading of all-reduces) against
the compiler's defaults; the host transfers of the offloaded values, which the predicted step leaves
out (theirs overlap them).
"""

from __future__ import annotations

import os
import sys
import time
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SOURCE = "https://github.com/AI-Hypercomputer/tpu-recipes/tree/main/training/trillium"
SEQUENCE = 8192


class TpuRun(NamedTuple):
    name: str
    model: str
    chips: int
    per_device_batch: int
    published_step: float  # seconds, as their log prints it
    published_tflops: float  # model TFLOP/s per chip, their count (no recomputation)
    published_tps: float  # tokens per second per chip
    kept: tuple  # the projections their remat policy offloads (kept here)
    their_setup: str


RUNS = (
    TpuRun("8b-v6e-8", "8b", 8, 3, 3.443, 413.433, 7_138.890, ("layer_input", "wq", "wk", "wv", "wo"),
           "Llama3.1-8B-MaxText/v6e-8 (MaxText tpu-recipes-v0.1.4, jax 0.6.1): FSDP 8, batch 3 a chip"),
    TpuRun("8b-v6e-256", "8b", 256, 4, 4.225, 449.171, 7_755.989, ("layer_input", "wq", "wk", "wv", "wo"),
           "Llama3.1-8B-MaxText/v6e-256 (MaxText 3ad02ba, libtpu 20241209): FSDP 256, batch 4 a chip"),
    TpuRun("70b-v6e-256", "70b", 256, 5, 42.656, 462.297, 960.248, ("layer_input", "wq", "wk", "wv"),
           "Llama3.1-70B-MaxText/v6e-256 (MaxText tpu-recipes-v0.1.4, jax 0.6.1): FSDP 256, batch 5 a chip"),
)


def predict(run: TpuRun) -> dict:
    import optax

    import parallax as px
    from benchmarks.llama import SHAPES, Llama, batch, lean_loss_fn

    shape = SHAPES[run.model]._replace(flash="tpu", saved=run.kept, offloaded=True)
    start = time.perf_counter()
    try:
        report = px.plan(Llama(shape), optax.adamw(3e-4), batch(run.per_device_batch * run.chips, SEQUENCE),
                         loss_fn=lean_loss_fn, strategies=[px.FSDP()], devices=run.chips, hardware="v6e", compile="jit",
                         memory_budget="10TB")  # their activations sit on the host: report the peak, search no fix
    except RuntimeError as err:  # the planning subprocess died: recorded, the other runs still planned
        return {"run": run._asdict(), "plan_seconds": time.perf_counter() - start, "error": str(err).splitlines()[0],
                "step": {}, "peak": None, "backend": None}
    row = report.rows[0]
    return {"run": run._asdict(), "plan_seconds": time.perf_counter() - start, "error": row.get("error"),
            "step": row.get("step") or {}, "peak": row.get("peak"), "backend": row.get("backend"),
            "mesh": row.get("mesh")}


def markdown(results: list[dict]) -> str:
    gib = 2**30
    lines = ["## px.plan on this CPU against MaxText's published TPU v6e runs", "",
             f"Source: {SOURCE} (each run's README). Hardware: `px.Hardware(\"v6e\")`, compiled by the TPU compiler "
             "for the slice without one; sequence 8192; the model `benchmarks/llama.py` (scanned, bf16, attention by "
             "jax's Pallas flash-attention kernel for TPUs, each block offloading to the host what their remat policy "
             "offloads, the loss `benchmarks.llama.lean_loss_fn`).", "",
             "| run | their setup | step published | step predicted | compute + memory + exposed "
             "| tok/s/chip published | predicted | predicted ÷ published | their TFLOP/s ÷ peak | peak planned "
             "| plan time |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        run, step = r["run"], r["step"]
        if not step:
            lines.append(f"| {run['name']} | {run['their_setup']} | {run['published_step']:.2f} s | not planned: "
                         f"{r['error']} | - | {run['published_tps']:,.0f} | - | - | - | - "
                         f"| {r['plan_seconds']:.0f} s |")
            continue
        tps = run["per_device_batch"] * SEQUENCE / step["seconds"]
        lines.append(
            f"| {run['name']} | {run['their_setup']} | {run['published_step']:.2f} s | {step['seconds']:.2f} s "
            f"| {step['compute']:.2f} + {step['memory']:.2f} + {step['exposed']:.2f} s | {run['published_tps']:,.0f} "
            f"| {tps:,.0f} | {tps / run['published_tps']:.2f} "
            f"| {run['published_tflops'] * 1e12 / step['peak_flops']:.1%} | {r['peak'] / gib:.1f} GiB "
            f"| {r['plan_seconds']:.0f} s |")
    lines += ["", "Step predicted: the compiled program's FLOPs (their recomputation included) at v6e's dense "
              "bf16 peak (918 TFLOP/s), its bytes at the memory bandwidth, the collectives on the critical path; "
              "a Pallas kernel by its blocks and matmuls over its grid (`parallax/pricing/kernel_cost.py`). "
              "Their TFLOP/s ÷ peak: their MFU (model FLOPs, no recomputation). "
              "Peak planned: the TPU compiler's program for the chip (its 31.25 GiB of HBM), as `px.plan` reads it."]
    return "\n".join(lines) + "\n"


def main() -> None:
    from benchmarks import published

    published(__doc__.splitlines()[0], "published_tpu", RUNS, predict, markdown,
              {"source": SOURCE, "sequence": SEQUENCE})


if __name__ == "__main__":
    main()
