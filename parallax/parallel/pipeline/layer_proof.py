"""Whether a layer a pipeline runs on microbatches computes, on each, what it computes on the batch.

A pipeline splits the activations entering its stack into microbatches and runs every layer on
each. That is the layer on the whole batch exactly when each example's output rows read only
that example's input rows (and the weights): what the loss's proof shows for the loss, here for
the layer. It fails for a capacity computed over the whole batch (GShard's routing over the
flattened batch x sequence: a ``cumsum`` along the tokens of every example), a statistic or a
softmax over the batch, or anything sized by the batch (a capacity ``factor * rows * k / E``,
which the two traces at two batch sizes show as different constants). The layer is traced at
the batch and at one microbatch and interpreted over :mod:`.domain`'s values: its per-example
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
from collections.abc import Sequence
from typing import Any

from parallax.jaxpr.per_example import first_difference
from parallax.jaxpr.per_example.domain import BatchSum, Fixed, NotPerExample, PerExample, kind_name
from parallax.jaxpr.per_example.interpret import Entry, interpret

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
