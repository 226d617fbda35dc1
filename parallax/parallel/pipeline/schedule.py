"""A stack of identical layers run as a pipeline over a mesh axis of stages.

The layers ``0 … N-1`` of a stack are split over the ``axis`` of ``stages`` devices in ``R·S``
groups of consecutive layers (``repeats=R``): with ``R=1`` (GPipe) stage ``s`` holds group ``s``;
with ``R>1`` (circular) it holds groups ``s, S+s, 2S+s, …`` and each microbatch goes round the
stages ``R`` times. Where ``R·S`` divides ``N`` every group holds ``L = N/(R·S)`` layers, layer
``(r·S + s)·L + j`` being stage ``s``'s group ``r``'s ``j``-th. Where it does not (126 layers over
8 stages), the first ``N mod R·S`` groups hold one layer more (:func:`parallax.parallel.pipeline.part.split_layers`)
and every group runs ``L = ⌈N/(R·S)⌉`` layer slots, a shorter group's last slot passing its input
on unchanged (``where``, its layer's result and gradient cut out): the stages stay in step, each
taking the time of ``L`` layers. The batch is split into ``microbatches`` (strided: microbatch ``m`` is rows
``m, m+M, m+2M, …``, so each keeps its share of every data shard), and one loop of
``T = R·M + S - 1`` iterations runs every stage at once on a different microbatch, passing
activations to the next stage with ``ppermute``. The bubble, the iterations where a stage has
no microbatch, is ``(S-1)/T`` of the loop; a stage computes on finite stand-in values there,
cut out of differentiation (``where`` with ``stop_gradient``, never a product with a mask),
so nothing it computes reaches the results or the gradients.

Gradients are autodiff's: the transpose of a ``ppermute`` is the ``ppermute`` back, so the
backward pass runs the schedule in reverse. Each iteration is rematerialised, keeping only the
stage's input (and what a ``policy`` keeps besides); with ``layer_remat`` (layers that rematerialise
themselves, ``PipelineParallel(remat="layer")``), each layer's input too, so that no layer is
computed forward three times.

Example:
    >>> mesh = jax.sharding.Mesh(jax.devices()[:4], ("stage",))
    >>> layer = lambda w, h, c, s: jnp.tanh(h @ w)
    >>> w, x = jnp.ones((8, 3, 3)) / 3, jnp.ones((6, 3))
    >>> piped = pipeline(layer, w, x, (), (), mesh=mesh, axis="stage", microbatches=2)
    >>> reference = jax.lax.scan(lambda h, wl: (layer(wl, h, (), ()), None), x, w)[0]
    >>> bool(jnp.allclose(piped, reference))
    True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, PartitionSpec

from parallax import _compat
from parallax.parallel.pipeline.part import split_layers

ITERATION_INPUT = "parallax_pipeline_iteration_input"  # the one value each iteration keeps for the backward pass
LAYER_INPUT = "parallax_pipeline_layer_input"  # each layer slot's input, kept where the layer rematerialises itself

Body = Callable[[Any, Any, Any, Any], Any]  # body(layer weights, activations, their constants, shared) -> activations


def pipeline(body: Body, weights: Any, inputs: Any, constants: Any, shared: Any, *, mesh: Mesh, axis: str,
             microbatches: int, repeats: int = 1, policy: Any = None, per_layer: Sequence[str] | None = None,
             layer_remat: bool = False) -> Any:
    """``lax.scan(body)`` over the stacked ``weights``, run as a pipeline over ``mesh``'s ``axis``.

    Args:
        body: one layer, ``body(w, h, c, s) -> h``: ``w`` the layer's slice of ``weights``, ``h``
            the activations (a pytree, every leaf with the batch as its leading dim), ``c`` the
            slice of ``constants`` for ``h``'s rows, ``s`` the ``shared`` values.
        weights: the stack's params, each leaf ``[N, ...]`` for ``N`` layers in order.
        inputs: the activations entering layer 0, each leaf ``[B, ...]``.
        constants: per-example values every layer reads (masks, positions), each leaf ``[B, ...]``.
        shared: values every layer reads whole (tables, params the layers share); their gradient
            sums every stage's.
        mesh: the mesh; only ``axis`` is made manual, every other axis keeps its automatic layout.
        axis: the stage axis (``S`` devices).
        microbatches: ``M``; divides ``B``; with ``repeats > 1`` at least ``S``.
        repeats: ``R``: each stage holds ``R`` non-adjacent groups of layers (circular). ``N``
            need not be a multiple of ``R·S``; it must be at least ``R·S``.
        policy: what each iteration keeps for the backward pass besides the stage's input (a
            ``jax.checkpoint`` policy, e.g. ``dots_saveable``: the matmuls' outputs, not
            recomputed); by default the stage's input alone.
        per_layer: where given, ``body`` returns ``(h, ys)``, a list of per-layer outputs (an
            auxiliary loss, per-layer statistics), and this says how each one's microbatches make
            the batch's: ``"rows"`` (each holds its rows on its leading dim), ``"mean"`` (a mean over
            the examples: the microbatches' averaged) or ``"same"`` (equal on every microbatch).
        layer_remat: ``body`` rematerialises itself (a ``jax.checkpoint`` around the layer, as
            ``nn.remat`` of a scanned block traces): each layer slot's input is kept as well, so
            the backward pass recomputes each layer once, inside its own checkpoint, instead of
            recomputing the whole iteration first (a third forward of every layer). It keeps what
            the same layers keep without a pipeline: one input per layer and microbatch.

    Returns:
        The activations after layer ``N-1``, laid out as ``inputs``; with ``per_layer``, also
        the per-layer outputs stacked ``[N, ...]`` as ``lax.scan`` stacks them.
    """
    stages = int(mesh.shape[axis])
    layers = {int(leaf.shape[0]) for leaf in jax.tree.leaves(weights)}
    rows = {int(leaf.shape[0]) for leaf in jax.tree.leaves((inputs, constants))}
    check(stages, microbatches, repeats, layers, rows)
    (count,), (batch,) = layers, rows
    per_stage, slots, real = _slots(count, stages, repeats)
    uneven = not real.all()
    if uneven:  # each group's L slots: its layers, then (a shorter group) its last layer again, passed over
        weights = jax.tree.map(lambda w: w[slots], weights)
    # Slot (r·S + s)·L + j goes to stage s as its (r·L + j)-th: each stage's layers contiguous.
    swap = lambda w: _swap_leading(w, (repeats, stages, per_stage))
    stage_major = (jax.tree.map(swap, weights), swap(jnp.asarray(real)) if uneven else None)
    split = lambda x: jnp.swapaxes(x.reshape(batch // microbatches, microbatches, *x.shape[1:]), 0, 1)
    merge = lambda x: jnp.swapaxes(x, 0, 1).reshape(batch, *x.shape[2:])
    layer = body if per_layer is not None else (lambda w, h, c, s: (body(w, h, c, s), []))
    local = _schedule(layer, stages, microbatches, repeats, per_stage, axis, policy, layer_remat)
    run = _compat.shard_map(local, mesh=mesh, in_specs=(PartitionSpec(axis),) + (PartitionSpec(),) * 3,
                            out_specs=PartitionSpec(axis), manual_axes={axis})
    outputs, ys = run(stage_major, jax.tree.map(split, inputs), jax.tree.map(split, constants), shared)
    outputs = jax.tree.map(lambda y: merge(y.reshape(stages, microbatches, *y.shape[1:])[stages - 1]), outputs)
    if per_layer is None:
        return outputs
    # Each stage's [R, M, L, ...] of its groups' slots: slot (r·S + s)·L + j first, then the microbatches combined.
    by_layer = [jnp.moveaxis(y.reshape(stages, repeats, microbatches, per_stage, *y.shape[3:]), 2, 3)
                .swapaxes(0, 1).reshape(len(slots), microbatches, *y.shape[3:]) for y in ys]
    if uneven:  # the layers' slots, in order
        by_layer = [y[np.flatnonzero(real)] for y in by_layer]
    return outputs, [_combined(y, kind, batch) for y, kind in zip(by_layer, per_layer, strict=True)]


def _combined(y: jax.Array, kind: str, batch: int) -> jax.Array:
    """A per-layer output ``[N, M, ...]`` of the ``M`` microbatches as the batch's ``[N, ...]``."""
    if kind == "rows":  # microbatch m holds rows m, m + M, ...: interleaved back
        return jnp.swapaxes(y, 1, 2).reshape(y.shape[0], batch, *y.shape[3:])
    if kind == "mean":
        return y.mean(1)
    if kind == "same":
        return y[:, 0]
    raise ValueError(f"per_layer={kind!r}; use 'rows', 'mean' or 'same'.")


def check(stages: int, microbatches: int, repeats: int, layers: set[int], rows: set[int]) -> None:
    """Raises ``ValueError`` naming the value and the fix where the stack cannot be pipelined so."""
    if len(layers) != 1:
        raise ValueError(f"The pipelined params are not one stack: their leading dims differ ({sorted(layers)}).")
    if len(rows) != 1:
        raise ValueError("The pipelined activations do not share one batch dim: their leading dims are "
                         f"{sorted(rows)}.")
    (count,), (batch,) = layers, rows
    if repeats < 1 or count < stages * repeats:
        raise ValueError(f"The stack has {count} layers, fewer than {stages} stages × repeats={repeats} groups of "
                         f"layers: use at most {count} stages × repeats.")
    if microbatches < 1 or batch % microbatches:
        raise ValueError(f"microbatches={microbatches} does not divide the batch of {batch} rows: use a divisor of "
                         f"{batch}, e.g. {max(d for d in range(1, min(batch, 4 * stages) + 1) if batch % d == 0)}.")
    if repeats > 1 and microbatches < stages:
        raise ValueError(f"A circular pipeline (repeats={repeats}) needs at least one microbatch per stage: "
                         f"microbatches={microbatches} < {stages} stages; use microbatches >= {stages}.")


def _slots(count: int, stages: int, repeats: int) -> tuple[int, np.ndarray, np.ndarray]:
    """Each group's slot count ``L``, and for every slot ``q·L + j`` (group ``q``, in layer order)
    the layer it runs and whether it is that layer's (``False``: a shorter group's extra slot,
    which runs its group's last layer again and passes its input on).

    Example:
        >>> _slots(5, 2, 1)
        (3, array([0, 1, 2, 3, 4, 4]), array([ True,  True,  True,  True,  True, False]))
    """
    sizes = split_layers(count, stages * repeats)
    starts = np.cumsum([0, *sizes[:-1]])
    per_stage = max(sizes)
    j = np.arange(per_stage)
    slots = np.concatenate([start + np.minimum(j, size - 1) for start, size in zip(starts, sizes)])
    real = np.concatenate([j < size for size in sizes])
    return per_stage, slots, real


def _swap_leading(w: jax.Array, shape: tuple[int, int, int]) -> jax.Array:
    repeats, stages, per_stage = shape
    if repeats == 1:
        return w
    grouped = w.reshape(repeats, stages, per_stage, *w.shape[1:])
    return jnp.swapaxes(grouped, 0, 1).reshape(w.shape)


def _keeping(policy: Any, layer_remat: bool = False) -> Any:
    """The iteration's checkpoint policy: its input kept (and each layer slot's, where the layers
    rematerialise themselves), and what ``policy`` keeps (or offloads)."""
    inputs = jax.checkpoint_policies.save_only_these_names(ITERATION_INPUT, *([LAYER_INPUT] if layer_remat else []))
    if policy is None:
        return inputs
    return lambda prim, *args, **params: inputs(prim, *args, **params) or policy(prim, *args, **params)


def _keep(valid: jax.Array, value: Any) -> Any:
    """``value`` where ``valid``; in a bubble the same values with no gradient path."""
    return jax.tree.map(lambda a: jnp.where(valid, a, jax.lax.stop_gradient(a)), value)


def _schedule(body: Body, stages: int, microbatches: int, repeats: int, per_stage: int, axis: str,
              policy: Any, layer_remat: bool = False) -> Callable:
    """The loop one stage runs: its weights ``[R·L, ...]``, all microbatches ``[M, mb, ...]`` in,
    its outputs of the last ``M`` iterations ``[M, mb, ...]`` out (stage ``S-1``'s are the stack's),
    and its layers' per-layer outputs ``[R, M, L, ...]`` (``body`` returns ``(h, ys)``)."""
    S, M, R, L = stages, microbatches, repeats, per_stage
    iterations = M * R + S - 1
    forward = [(i, (i + 1) % S) for i in range(S)] if R > 1 else [(i, i + 1) for i in range(S - 1)]

    def local(weights: Any, inputs: Any, constants: Any, shared: Any) -> Any:
        stage = jax.lax.axis_index(axis)
        grouped = jax.tree.map(lambda w: w.reshape(R, L, *w.shape[1:]), weights)  # (params, real slots or None)

        def layer_slot(h: Any, weights: Any, c: Any, s: Any) -> tuple[Any, Any]:
            w, real = weights
            if layer_remat:
                h = checkpoint_name(h, LAYER_INPUT)
            out, ys = body(w, h, c, s)
            if real is not None:  # a shorter group's extra slot passes its input on
                out = jax.tree.map(lambda o, x: jnp.where(real, o, x), out, h)
            return out, ys

        def iteration(carry, t):
            received, stored = carry
            done = t - stage  # microbatch-steps this stage has done before this iteration
            valid = (done >= 0) & (done < M * R)
            clipped = jnp.clip(done, 0, M * R - 1)
            microbatch, group = clipped % M, clipped // M
            fresh = jax.tree.map(lambda x: x[jnp.minimum(t, M - 1)], inputs)
            if R > 1:  # stage 0 files what stage S-1 sent round, then takes its next microbatch
                slot = jnp.remainder(t - S, M)
                stored = jax.tree.map(lambda b, h: b.at[slot].set(jnp.where((stage == 0) & (t >= S), h, b[slot])),
                                      stored, received)
                fresh = jax.tree.map(lambda x, b: jnp.where(t < M, x, b[jnp.remainder(t, M)]), fresh, stored)
            h = _keep(valid, jax.tree.map(lambda a, b: jnp.where(stage == 0, a, b), fresh, received))
            h = checkpoint_name(h, ITERATION_INPUT)
            w = _keep(valid, jax.tree.map(lambda a: a[group], grouped))
            c = _keep(valid, jax.tree.map(lambda a: a[microbatch], constants))
            s = _keep(valid, shared)
            out, ys = jax.lax.scan(lambda hh, wl: layer_slot(hh, wl, c, s), h, w)
            return (jax.tree.map(lambda o: jax.lax.ppermute(o, axis, forward), out), stored), (out, ys)

        iteration = jax.checkpoint(iteration, prevent_cse=False, policy=_keeping(policy, layer_remat))
        first = jax.tree.map(lambda x: jnp.zeros_like(x[0]), inputs)
        stored = jax.tree.map(jnp.zeros_like, inputs) if R > 1 else None
        _, (outputs, ys) = jax.lax.scan(iteration, (first, stored), jnp.arange(iterations))
        # Iteration stage + r·M + m ran group r of microbatch m here: [R, M, L, ...] per stage.
        ys = [jax.lax.dynamic_slice_in_dim(y, stage, M * R, 0).reshape(R, M, *y.shape[1:]) for y in ys]
        return jax.tree.map(lambda y: y[iterations - M:], outputs), ys

    return local
