"""Which of a pipelined layer's operands hold the examples, and the proof that the layer computes
each example on its own, so that microbatches compute what the batch does.

A pipeline splits the activations and every per-example value its layers read into microbatches.
A layer that mixes examples (a capacity over the whole batch, a statistic over it) would compute
other values per microbatch than on the batch: :func:`check_per_example` refuses it before
anything compiles, with the proof the step passes in
(:func:`parallax.parallel.pipeline.layer_proof.prove_layer`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

BATCH = "batch"  # a value computed from the batch (the kinds pipeline_stack tracks)


def check_per_example(prove: Callable | None, microbatches: int, full: Any, micro: Any, per_example: Sequence[bool],
                      rows: int, carry: Sequence[int], subject: str, per_layer: Sequence[int] = ()) -> list[str]:
    """Refuses a layer that does not compute each example on its own (``prove``): run on
    microbatches, it would compute other values than on the batch, silently. Returns how each of
    the ``per_layer`` outputs of the microbatches makes the batch's (``"rows"``, ``"mean"``, ``"same"``)."""
    if prove is None:
        if per_layer:
            raise ValueError(f"{subject} return outputs per layer (its ys), which the model reads: without the "
                             "proof that each is per example or a mean over them, a pipeline cannot combine its "
                             "microbatches'.")
        return []
    micro_rows = rows // microbatches
    proof = prove(full, micro, per_example=per_example, rows=rows, micro_rows=micro_rows, carry=tuple(carry),
                  per_layer=tuple(per_layer))
    if proof:
        return list(proof.outputs)
    where = f" (at {proof.where})" if proof.where else ""
    raise ValueError(
        f"{subject} do not compute each example on its own: {proof.reason}{where}. A pipeline runs them on "
        f"microbatches of {micro_rows} of the batch's {rows} rows, where this computes other values than on the whole "
        "batch (a mixture of experts whose capacity counts the tokens of the whole batch drops other tokens per "
        "microbatch), and trains differently from one device. Compute it within each example: route a mixture of "
        "experts' tokens in groups of one sequence (a capacity per sequence), normalise over features, not over the "
        "batch; or train without PipelineParallel (data, FSDP, tensor, context and expert parallelism split no batch "
        "into microbatches).")


def per_example_operands(positions: Sequence[int], values: Sequence[Any], kinds: Sequence[frozenset], body: Any,
                 rows: set[int], subject: str) -> list[int]:
    """Of the layer's other operands at ``positions``, those split into microbatches with the
    activations: computed from the batch, or taken smaller by the layer traced on a microbatch."""
    found = [p for p in positions if BATCH in kinds[p] or smaller_in(body, p, values[p])]
    if any(jax.numpy.ndim(values[p]) == 0 or int(values[p].shape[0]) not in rows for p in found):
        raise ValueError(
            f"{subject} read a value computed from the batch whose leading dim is not the batch's ({sorted(rows)} "
            "rows): a pipeline splits such values into microbatches with the activations. Give it the batch as its "
            "leading dim.")
    return found


def smaller_in(body: Any, position: int, value: Any) -> bool:
    """Whether the layer, traced on a microbatch, takes a smaller leading dim at ``position`` than
    ``value`` has: a per-example value the model computed from the batch's shape alone (positions
    made with ``np.arange``), which the pipeline splits into microbatches like the batch."""
    shape = body.jaxpr.invars[position].aval.shape
    return jax.numpy.ndim(value) > 0 and len(shape) > 0 and shape[0] < jax.numpy.shape(value)[0]
