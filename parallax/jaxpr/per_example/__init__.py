"""Reading from a loss's trace whether it is a mean of per-example terms.

A loss as written must see the global batch (the ``jit`` path) unless computing it per data
shard and averaging the shards gives the same number. That holds when the loss is
``α · Σ_i f(example_i) + c``, with ``α`` one over the batch size times a constant (a mean),
``f`` reading one example at a time and ``c`` not reading the batch. It fails for a
masked-token mean (divided by a count over the batch), batch statistics the shards do not
share (an MoE load-balancing term), in-batch negatives, dropout (each shard would draw its own
mask) and a divisor written into the code (``sum / 256``). BatchNorm's statistics are traced
as the ``shard_map`` path computes them, summed over the data shards (``psum``): a sum of each
shard's mean holds the whole batch's mean on every shard, so it is batch-free from there.

:func:`prove_loss` traces the step's loss at the global batch and at one shard's batch and
interprets both jaxprs over four abstract values (:mod:`.domain`): batch-free, per-example
(which dim runs over the examples), a batch-wide sum (with its literal scales) and random.
Two traces make the batch size visible: a mean's divisor scales with it, a written-in one
does not, and anything else read from the batch size changes the trace. Whatever the rules
do not know (:mod:`.rules`) is "not proven", and the loss keeps the global batch: the proof
only ever opens the per-shard path where it is exact.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from parallax._errors import first_line
from parallax.jaxpr.per_example.domain import BatchSum, Fixed, NotPerExample, PerExample, Random, kind_name
from parallax.jaxpr.per_example.interpret import SYNCED, Entry, interpret


@dataclasses.dataclass(frozen=True)
class Proof:
    """Whether a loss traced as a mean of per-example terms, and if not, why.

    Attributes:
        proven: computing the loss and every metric per data shard and averaging (the
            ``shard_map`` path) gives the global batch's values, up to float rounding.
        reason: what the trace showed, for ``Step.describe()``.
        where: the source line of the equation that mixes examples, where the trace says.
    """

    proven: bool
    reason: str
    where: str | None = None

    def __bool__(self) -> bool:
        return self.proven


def prove_loss(loss: Callable, params: Any, model_state: Any, batch: Any, key: Any, shards: int,
               data_axes: Sequence[tuple[str, int]] = (), draws: bool = False) -> Proof:
    """Whether ``loss(params, model_state, batch, key) -> (value, (sums, new_model_state))``
    (the step's loss closure) may run per data shard.

    Args:
        loss: the closure (:func:`parallax.step.loss.loss_closure`).
        params, model_state, batch, key: its arguments (arrays or ``jax.ShapeDtypeStruct``),
            the batch as the loss sees it on the global batch (one microbatch).
        shards: how many data shards split that batch.
        data_axes: ``(name, size)`` of the data axes the closure may ``psum`` over (BatchNorm's
            statistics on the ``shard_map`` path). A ``psum`` of a mean over the examples holds
            the whole batch's mean on every shard, so it counts as batch-free; of anything else
            it is refused.
        draws: read a random draw with the batch's rows leading as per-example values, any
            other as one value for all (gradient accumulation: each microbatch draws its rows
            from its own key, a mask of the same distribution); by default a draw is refused
            (each data shard would draw its own numbers from the one key).
    """
    params, model_state, batch, key = jax.tree.map(_abstract, (params, model_state, batch, key))
    rows = int(jax.tree.leaves(batch)[0].shape[0])
    if shards < 2 or rows % shards:
        return Proof(False, f"{rows} examples do not split into {shards} shards")
    local = jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[0] // shards, *x.shape[1:]), x.dtype), batch)
    traces = []
    for this_batch, size in ((batch, rows), (local, rows // shards)):
        args = (params, model_state, this_batch, key)
        try:
            closed, shape = jax.make_jaxpr(loss, axis_env=list(data_axes), return_shape=True)(*args)
        except Exception as err:
            where = "the global batch" if size == rows else "one shard's batch"
            return Proof(False, f"it does not trace at {where} ({type(err).__name__}: "
                                f"{first_line(err, 160)})")
        inputs = ([Fixed()] * len(jax.tree.leaves(params)) + [Fixed()] * len(jax.tree.leaves(model_state))
                  + [PerExample(0)] * len(jax.tree.leaves(this_batch))
                  + [Fixed() if draws else Random()] * len(jax.tree.leaves(key)))
        signature: list = []
        try:
            outputs = interpret(closed, inputs, signature, size if draws else None)
        except NotPerExample as why:
            return Proof(False, str(why), why.where)
        except Exception as err:
            return Proof(False, f"the proof could not read its trace ({type(err).__name__}: {err})")
        value, (sums, new_model_state) = jax.tree.unflatten(jax.tree.structure(shape), outputs)
        traces.append((value, sums, jax.tree.leaves(new_model_state, is_leaf=_is_abstract), signature, size))
    (value, sums, state, signature, size), (value_l, sums_l, state_l, signature_l, size_l) = traces
    try:
        _mean(value, value_l, size, size_l)
        for name, (total, count) in sums.items():
            _sum(total, sums_l[name][0], f"metric {name!r}", shards)
            if isinstance(count, Fixed) and isinstance(count_l := sums_l[name][1], Fixed):
                if count.value is None or count_l.value is None or not _close(count.value, shards * count_l.value):
                    raise NotPerExample(f"metric {name!r}'s count is not the number of examples it averages")
            else:
                _sum(count, sums_l[name][1], f"metric {name!r}'s count", shards)
        for leaf in state + state_l:
            _random(leaf)
            if not isinstance(leaf, Fixed):
                raise NotPerExample("it updates model state (e.g. BatchNorm statistics) from the batch")
    except NotPerExample as why:
        return Proof(False, str(why), why.where)
    try:
        signature, signature_l = _synced_means(signature, size), _synced_means(signature_l, size_l)
    except NotPerExample as why:
        return Proof(False, str(why))
    if signature != signature_l:
        return Proof(False, "it computes differently at one shard's batch size (it reads the batch size)",
                     first_difference(signature, signature_l))
    return Proof(True, "the loss traces as a mean of per-example terms")


def first_difference(signature: list, other: list) -> str | None:
    """Where two traces' signatures first differ: the primitive and its source line."""
    for a, b in zip(signature, other):
        if a != b:
            return a.describe() if isinstance(a, Entry) else None
    return None


def _synced_means(signature: list, size: int) -> list:
    """The signature with each sum synced over the data shards replaced by its factors times
    the batch size: equal in both traces exactly when it is a mean (the shards' means summed
    are the whole batch's, as every shard holds it in the global trace)."""
    out = []
    for entry in signature:
        if not isinstance(entry, tuple) or entry[0] != SYNCED:
            out.append(entry)
            continue
        _, scales, offsets = entry
        if None in scales + offsets:
            raise NotPerExample("it sums over the data shards a value scaled by one computed in the loss")
        out.append((SYNCED, tuple(round(a * size, 9) for a in scales), tuple(round(c, 9) for c in offsets)))
    return out


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
    dtype = x.dtype  # a host batch may hold int64/float64: what jax would make of it
    return jax.ShapeDtypeStruct(jax.numpy.shape(x), jax.dtypes.canonicalize_dtype(dtype)
                                if isinstance(dtype, np.dtype) else dtype)


def _is_abstract(x: Any) -> bool:
    return isinstance(x, (Fixed, PerExample, BatchSum, Random))


def _random(value: Any) -> None:
    if isinstance(value, Random):
        raise NotPerExample("it draws random numbers from the step's key (e.g. dropout): each shard would draw its own")


def _factors(whole: Any, shard: Any, what: str) -> list[tuple[float, float]]:
    """The paired literal factors (of the sums over examples, then of the batch-free offsets)."""
    _random(whole)
    _random(shard)
    if not isinstance(whole, BatchSum) or not isinstance(shard, BatchSum):
        raise NotPerExample(f"{what} is {kind_name(whole)}, not a sum or mean over the examples")
    factors = whole.scales + whole.offsets + shard.scales + shard.offsets
    if len(whole.scales) != len(shard.scales) or len(whole.offsets) != len(shard.offsets) or None in factors:
        raise NotPerExample(f"{what} scales a sum over the batch by a value computed in the loss")
    return list(zip(whole.scales, shard.scales)) + list(zip(whole.offsets, shard.offsets))


def _mean(whole: Any, shard: Any, size: int, local_size: int) -> None:
    """Each shard's value averaged over the shards is the whole's: a sum's factor scales as one
    over the batch size; a batch-free term stays as it is."""
    sums = len(whole.scales) if isinstance(whole, BatchSum) else 0
    for index, (a, b) in enumerate(_factors(whole, shard, "the loss")):
        if index < sums and not _close(a * size, b * local_size):
            raise NotPerExample(f"the loss divides a sum over the examples by {1 / a:g}, which does not scale with "
                                f"the batch size {size} (a divisor written into the loss?)")
        if index >= sums and not _close(a, b):
            raise NotPerExample("the loss scales a term that does not read the batch by the batch size")


def _sum(whole: Any, shard: Any, what: str, shards: int) -> None:
    """Each shard's value summed over the shards is the whole's: a sum's factor stays as it is;
    a batch-free term must scale with the batch size (a mean times its count)."""
    sums = len(whole.scales) if isinstance(whole, BatchSum) else 0
    for index, (a, b) in enumerate(_factors(whole, shard, what)):
        if index < sums and not _close(a, b):
            raise NotPerExample(f"{what} does not add up over the shards")
        if index >= sums and not _close(a, shards * b):
            raise NotPerExample(f"{what} adds a term that does not read the batch")


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-300)
