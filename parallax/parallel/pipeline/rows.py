"""Which of a pipelined layer's operands hold the examples, and the proof that the layer computes
each example on its own, so that microbatches compute what the batch does.

A pipeline splits the activations and every per-example value its layers read into microbatches.
A layer that mixes examples (a capacity over the whole batch, a statistic over it) would compute
other values per microbatch than on the batch: :func:`check_per_example` refuses it before
anything compiles, with the proof the step passes in
(:func:`parallax.parallel.pipeline.rows.prove_layer`).

Whether a layer a pipeline runs on microbatches computes, on each, what it computes on the batch.

A pipeline splits the activations entering its stack into microbatches and runs every layer on
each. That is the layer on the whole batch exactly when each example's output rows read only
that example's input rows (and the weights): what the loss's proof shows for the loss, here for
the layer. It fails for a capacity computed over the whole batch (GShard's routing over the
flattened batch x sequence: a ``cumsum`` along the tokens of every example), a statistic or a
softmax over the batch, or anything sized by the batch (a capacity ``factor * rows * k / E``,
which the two traces at two batch sizes show as different constants). The layer is traced at
the batch and at one microbatch and interpreted over :mod:`parallax.jaxpr.per_example.domain`'s values: its per-example
inputs (the activations and the per-example constants) as per-example values, its weights and
shared values as batch-free, its per-example random draws (dropout), which a pipeline makes as
one device does, as per-example values.

Example:
    >>> def layer(w, h):  # each row on its own: per example
    ...     return (jnp.tanh(h @ w),)
    >>> def routed(w, h):  # a capacity over the batch: each row's slot counts the rows before it
    ...     return (h * (jnp.cumsum(h @ w, axis=0) < 2),)
    >>> w = jnp.ones((3, 3))
    >>> traces = lambda f: [jax.make_jaxpr(f)(w, jnp.ones((rows, 3))) for rows in (8, 4)]
    >>> prove_layer(*traces(layer), per_example=(False, True), rows=8, micro_rows=4, carry=(0,)).proven
    True
    >>> proof = prove_layer(*traces(routed), per_example=(False, True), rows=8, micro_rows=4, carry=(0,))
    >>> proof.proven, proof.reason
    (False, 'it takes cumsum along the examples')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from parallax.jaxpr.per_example import first_difference
from parallax.jaxpr.per_example.domain import BatchSum, Fixed, NotPerExample, PerExample, kind_name
from parallax.jaxpr.per_example.interpret import Entry, interpret

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


_PLACING = {"sharding_constraint", "reshard", "mesh_cast", "pvary"}
ROWS, MEAN, SAME = "rows", "mean", "same"  # how a per-layer output of the microbatches makes the batch's


@dataclasses.dataclass(frozen=True)
class LayerProof:
    """Whether a layer computes per example, and if not, where and why.

    Attributes:
        proven: the layer on each microbatch computes the batch's rows (up to float rounding).
        reason: what the trace showed.
        where: the source line of the equation that mixes examples, where the trace says.
        outputs: for each of ``per_layer``'s outputs, how the microbatches' values make the
            batch's: ``"rows"`` (each microbatch holds its rows), ``"mean"`` (a mean over the
            examples: the microbatches' means averaged) or ``"same"`` (it does not read the batch).
    """

    proven: bool
    reason: str
    where: str | None = None
    outputs: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return self.proven


def prove_layer(full: Any, micro: Any, *, per_example: Sequence[bool], rows: int, micro_rows: int,
                carry: Sequence[int], per_layer: Sequence[int] = ()) -> LayerProof:
    """Whether ``micro`` (one layer traced on a microbatch of ``micro_rows`` rows) computes what
    ``full`` (the same layer traced on the batch of ``rows``) computes, row by row.

    Args:
        full, micro: the layer's (closed) jaxprs, with the same inputs and outputs.
        per_example: for each input, whether it holds the examples on its leading dim (the
            activations and per-example constants); the others are weights and shared values.
        rows, micro_rows: the examples in each trace.
        carry: the outputs that must be per-example rows (the activations passed on).
        per_layer: other outputs the model reads (an auxiliary loss per layer): each must be
            per-example rows, a mean over the examples, or independent of the batch.
    """
    traces = []
    for closed, size in ((full, rows), (micro, micro_rows)):
        inputs = [PerExample(0) if flag else Fixed() for flag in per_example]
        signature: list = []
        try:
            outputs = interpret(closed, inputs, signature, draws=size)
            for index in carry:
                _rows(outputs[index], "the activations it passes on")
        except NotPerExample as why:
            return LayerProof(False, str(why), why.where)
        except Exception as err:
            return LayerProof(False, f"the proof could not read the layer's trace ({type(err).__name__}: {err})")
        traces.append((outputs, signature))
    (outputs, signature), (outputs_micro, signature_micro) = traces
    try:
        kinds = tuple(_combined(outputs[i], outputs_micro[i], rows, micro_rows) for i in per_layer)
    except NotPerExample as why:
        return LayerProof(False, str(why))
    signature, signature_micro = _computing(signature), _computing(signature_micro)
    if signature != signature_micro:
        return LayerProof(False, "it computes differently on a microbatch (it reads the batch's size, e.g. a capacity "
                                 "computed from the number of rows)", first_difference(signature, signature_micro))
    return LayerProof(True, "each example's rows read only that example's rows", outputs=kinds)


def _computing(signature: list) -> list:
    """The entries that compute: where a value is placed (a sharding constraint that expert
    parallelism pins where the shape divides over the axes) may differ between a batch and a
    microbatch without changing what is computed."""
    return [e for e in signature if not (isinstance(e, Entry) and e.key[0] in _PLACING)]


def _rows(value: Any, what: str) -> None:
    """``value`` holds one row per example on its leading dim (or the same for every example)."""
    if isinstance(value, PerExample) and value.dim == 0 and value.block == 1:
        return
    if isinstance(value, Fixed) and 0 in value.uniform:
        return
    raise NotPerExample(f"{what} are {kind_name(value)} not laid out one row per example")


def _combined(whole: Any, part: Any, rows: int, micro_rows: int) -> str:
    """How the microbatches' values of a per-layer output make the batch's."""
    if isinstance(whole, PerExample) and isinstance(part, PerExample):
        _rows(whole, "a per-layer output")
        return ROWS
    if isinstance(whole, Fixed) and isinstance(part, Fixed):
        return SAME
    if isinstance(whole, BatchSum) and isinstance(part, BatchSum):
        pairs = list(zip(whole.scales, part.scales))
        if (len(whole.scales) == len(part.scales) and whole.offsets == part.offsets and None not in whole.scales
                and None not in part.scales and all(abs(a * rows - b * micro_rows) <= 1e-9 * abs(a * rows)
                                                     for a, b in pairs)):
            return MEAN
        raise NotPerExample("a per-layer output sums over the batch without being its mean (averaging the "
                            "microbatches' values would not give the batch's)")
    raise NotPerExample(f"a per-layer output is {kind_name(whole)}: neither rows per example, a mean over them, nor "
                        "independent of the batch")
