"""How far float32 rounding can move each param through the optimizer: the params' tolerance.

Two correct runs of the same training differ by rounding. A sum over the batch taken in
another order (another mesh, another CPU's vector width, another XLA version) gives a
gradient that differs in its last bits, and most params then differ by as little. But an
optimizer can amplify it. Adam's first step moves a param by ``lr * g / (|g| + eps)``: a
gradient that is near zero by cancellation (``|g|`` near ``eps``) turns a rounding change of
1e-9 into a param change of 1e-5, and a param whose gradient is zero in exact arithmetic (a
bias followed by BatchNorm) moves by up to ``lr`` a step, driven by rounding alone. The
loss and the optimizer state show none of it. No single bound tells that apart from a bug
and still catches bugs in the other params, so each param gets its own allowance:

1. :func:`gradient_rounding` measures the rounding level of each step's gradient: per leaf,
   the largest difference between the one-device gradient and the same gradient computed
   again in other roundings, at least one float32 ulp of the leaf's largest gradient; none
   where the gradient is exactly zero in all of them (a unit no example reached). Two
   recomputations are used: the same function with its inputs placed on a mesh (another
   reduction order of the sums the mesh splits), and on one device at params moved one
   float32 ulp up or down at random (:func:`dither`), which changes every rounding of the
   computation, inside each example too. The second is what sees a gradient that is zero in
   exact arithmetic by cancellation inside the model (an attention's key bias: the softmax
   does not change when a query's scores all move together), whose computed value is
   rounding alone and whose sign the mesh's order can leave untouched while a strategy's does
   not.
2. :func:`optimizer_rounding` reruns the optimizer alone on the one-device run's recorded
   gradients, each step's gradients pushed up and then down by that step's rounding level,
   and sums over the steps how far each final param moves: the param's sensitivity.

:func:`rounding_allowance` does both, pushing by :data:`LEVEL_MARGIN` times the level (a
strategy's own computation may round more than the one device's: a ring's online softmax
did, 1.8 times), and scales the sensitivity by :data:`ROUNDING_MARGIN`.

A param is then held to the float32 bound plus :data:`ROUNDING_MARGIN` times its
sensitivity. For SGD the sensitivity is ``lr`` times the rounding level (nothing); for Adam
it is large only where the gradient was near ``eps``, so a bug in any other param is caught
as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from parallax._tree import path_str

__all__ = ["LEVEL_MARGIN", "ROUNDING_MARGIN", "dither", "excess", "gradient_rounding", "optimizer_rounding",
           "rounding_allowance"]

# the sensitivity alone was 1.9–4.1× the drift seen across stacks and ISAs (docs/guides/testing-your-model.md)
ROUNDING_MARGIN = 2.0
LEVEL_MARGIN = 2.0  # a strategy's own roundings of a gradient were up to 1.8× the level read on one device (a ring's)


def dither(tree: Any, seed: int = 0) -> Any:
    """``tree`` with every floating element moved one ulp of its dtype up or down, at random.

    The gradient at dithered params is a recomputation in other roundings: every product and
    sum of the model changes its last bits, so its difference from the gradient at the params
    themselves samples how far rounding moves each gradient element (the params move by an
    amount a single rounding could have made). Integer leaves (rng keys, counters) are kept.

    Args:
        tree: a tree of arrays (host or device).
        seed: the seed of the up-or-down choice.

    Returns:
        A tree like ``tree`` of host arrays.

    Example:
        >>> w = np.array([1.5, -3.0], np.float32)
        >>> moved = px.testing.dither({"w": w, "n": np.array([3])})
        >>> np.abs(moved["w"] - w) == np.abs(np.spacing(w))  # each a float32 ulp up or down
        array([ True,  True])
        >>> moved["n"]
        array([3])
    """
    rng = np.random.default_rng(seed)

    def move(x):
        x = np.asarray(jax.device_get(x))
        if not jnp.issubdtype(x.dtype, jnp.floating):  # bfloat16 too
            return x
        ends = np.where(rng.random(x.shape) < 0.5, -np.inf, np.inf).astype(x.dtype)
        return np.nextafter(x, ends)

    return jax.tree.map(move, tree)


def gradient_rounding(grads: Any, *others: Any) -> Any:
    """The rounding level of a gradient: how far other roundings moved it, per leaf.

    Args:
        grads: the one-device gradient (a tree of arrays).
        *others: the same gradient computed again in other roundings at the same batch: with its
            inputs placed on a mesh (another reduction order), or at :func:`dither`'s params.

    Returns:
        A tree like ``grads`` of float32 arrays: in each leaf, the largest
        ``|grads - other|`` of the leaf over ``others`` (at least one float32 ulp of its largest
        ``|grads|``), except 0 where every gradient is exactly 0 (a unit no example reached: no
        sum to round).

    Example:
        >>> g = {"w": np.array([1.0, -2.0, 0.0], np.float32)}
        >>> other = {"w": np.array([1.0 + 2**-20, -2.0, 0.0], np.float32)}  # 1.0 one ulp up, in float32
        >>> px.testing.gradient_rounding(g, other)["w"] * 2**20
        array([1., 1., 0.], dtype=float32)
        >>> cancelled = {"w": np.array([3e-9, -1e-9, 2e-9], np.float32)}  # zero in exact arithmetic
        >>> px.testing.gradient_rounding(cancelled, cancelled, {"w": np.array([-1e-9, 2e-9, 0.0], np.float32)})["w"]
        array([4.e-09, 4.e-09, 4.e-09], dtype=float32)
    """
    if not others:
        raise ValueError("gradient_rounding needs the gradient computed again at least once (others).")

    def level(a, *bs):
        a = np.asarray(a, np.float64)
        if not a.size:
            return np.zeros(a.shape, np.float32)
        bs = [np.asarray(b, np.float64) for b in bs]
        widest = max(max(np.abs(a - b).max() for b in bs), np.finfo(np.float32).eps * np.abs(a).max())
        untouched = np.logical_and.reduce([a == 0, *(b == 0 for b in bs)])
        return np.where(untouched, 0.0, widest).astype(np.float32)

    return jax.tree.map(level, grads, *others)


def optimizer_rounding(optimizer: optax.GradientTransformation, params: Any, opt_state: Any,
                       grads: Sequence[Any], rounding: Sequence[Any]) -> Any:
    """Per param element, how far the final params move when each step's gradients move by their rounding level.

    The optimizer alone is rerun from ``params`` and ``opt_state`` on the recorded
    ``grads`` (the model is not run again), once as recorded and, for each step ``t``, with
    step ``t``'s gradients pushed up by ``rounding[t]`` and once pushed down. The result is
    the sum over steps of the larger of the two moves of each final param. It is exact
    (not linearised), so a gradient whose sign a push flips counts its whole effect.

    Args:
        optimizer: the optax transformation the runs use.
        params: the initial params; ``opt_state`` the optimizer's initial state for them.
        grads: the gradient of each step of the one-device run.
        rounding: each step's rounding level, a tree like the gradients of arrays (or
            scalars, for a whole leaf) (:func:`gradient_rounding`).

    Returns:
        A tree like ``params`` of host arrays: each element's sensitivity.

    Example:
        >>> p = {"w": np.zeros(3, np.float32)}
        >>> g = [{"w": np.array([1.0, 1e-9, 0.0], np.float32)}] * 2
        >>> d = [{"w": np.float32(1e-8)}] * 2
        >>> sgd = px.testing.optimizer_rounding(optax.sgd(0.1), p, optax.sgd(0.1).init(p), g, d)["w"]
        >>> bool(np.allclose(sgd, 2 * 0.1 * 1e-8))  # SGD: lr times the rounding, per step
        True
        >>> adam = optax.adam(1e-3)
        >>> s = px.testing.optimizer_rounding(adam, p, adam.init(p), g, d)["w"]
        >>> bool(s[0] < 1e-9 and s[1] > 1e-4)  # Adam: large only where the gradient is near eps
        True
    """
    steps = len(grads)
    if steps != len(rounding) or not steps:
        raise ValueError(f"optimizer_rounding needs one rounding level per step: {steps} gradients, "
                         f"{len(rounding)} levels.")
    stacked = jax.tree.map(lambda *g: np.stack([np.asarray(x) for x in g]), *grads)
    levels = jax.tree.map(lambda g, *d: np.stack([np.broadcast_to(np.asarray(x, g.dtype), g.shape[1:]) for x in d]),
                          stacked, *rounding)

    # One program, the optimizer scanned over the steps with step ``push``'s gradients moved by
    # ``sign`` times its level (``sign`` 0: as recorded), run 1 + 2 * steps times. Its values are
    # arguments, not constants folded into it: it compiles as fast for any params, and once per model
    # and optimizer in a process that checks several strategies. (One program running every push
    # compiled three scans of the optimizer and took three times as long to compile.)
    def final(params, opt_state, grads_seq, levels, push, sign):
        def update(carry, step_grad):
            (current, state), (index, grad, level) = carry, step_grad
            grad = jax.tree.map(lambda g, d: jnp.where(index == push, g + sign * d, g), grad, level)
            updates, state = optimizer.update(grad, state, current)
            return (optax.apply_updates(current, updates), state), None

        return jax.lax.scan(update, (params, opt_state), (jnp.arange(steps), grads_seq, levels))[0][0]

    run = jax.jit(final)
    params, opt_state, stacked, levels = jax.device_put((params, opt_state, stacked, levels))

    def as_float32(tree):
        return [np.asarray(leaf, np.float32) for leaf in jax.tree.leaves(jax.device_get(tree))]

    base = as_float32(run(params, opt_state, stacked, levels, -1, 0))
    total = [np.zeros(leaf.shape, np.float32) for leaf in base]
    for step in range(steps):
        up, down = (as_float32(run(params, opt_state, stacked, levels, step, sign)) for sign in (1, -1))
        total = [t + np.maximum(np.abs(a - b), np.abs(c - b)) for t, a, c, b in zip(total, up, down, base)]
    return jax.tree.unflatten(jax.tree.structure(params), total)


def rounding_allowance(optimizer: optax.GradientTransformation, params: Any, opt_state: Any,
                       grads: Sequence[Any], *other_grads: Sequence[Any]) -> Any:
    """Each param element's allowance: :data:`ROUNDING_MARGIN` times its :func:`optimizer_rounding`
    at :data:`LEVEL_MARGIN` times the rounding level :func:`gradient_rounding` reads off ``grads``
    and ``other_grads``.

    Args:
        optimizer: the optax transformation the runs use.
        params: the initial params; ``opt_state`` the optimizer's initial state for them.
        grads: the gradient of each step of the one-device run (host arrays).
        *other_grads: one or more recomputations: each step's gradient computed again at the same
            inputs in other roundings (placed on a mesh; at :func:`dither`'s params).

    Example:
        >>> p = {"w": np.zeros(2, np.float32)}
        >>> g = [{"w": np.array([1.0, 0.0], np.float32)}]
        >>> other = [{"w": np.array([1.0, 2e-9], np.float32)}]  # rounding left 2e-9 where the sum is 0
        >>> adam = optax.adam(1e-3)
        >>> a = px.testing.rounding_allowance(adam, p, adam.init(p), g, other)["w"]
        >>> bool(a[0] < 1e-9 and a[1] > 1e-4)
        True
    """
    rounding = [jax.tree.map(lambda level: LEVEL_MARGIN * level, gradient_rounding(g, *o))
                for g, *o in zip(grads, *other_grads, strict=True)]
    sensitivity = optimizer_rounding(optimizer, params, opt_state, grads, rounding)
    return jax.tree.map(lambda s: ROUNDING_MARGIN * s, sensitivity)


def excess(values: Any, reference: Any, allowance: Any = None) -> dict[str, float]:
    """Per floating leaf path, the largest ``|values - reference| - allowance`` (0 where every element is within).

    Without ``allowance``, the largest ``|values - reference|``. Integer leaves (rng keys,
    counters) and empty ones are left out.

    Example:
        >>> px.testing.excess({"w": np.array([1.0, 2.0])}, {"w": np.array([1.5, 2.0])}, {"w": np.array([0.1, 0.0])})
        {'w': 0.4}
    """
    flat = jax.tree_util.tree_flatten_with_path(values)[0]
    allowed = [0.0] * len(flat) if allowance is None else jax.tree.leaves(allowance)
    rows = {}
    for (path, a), b, slack in zip(flat, jax.tree.leaves(reference), allowed, strict=True):
        if not (jnp.issubdtype(getattr(a, "dtype", np.float64), jnp.floating) and np.size(a)):
            continue
        over = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)) - np.asarray(slack, np.float64)
        rows[path_str(path) or "(root)"] = max(float(over.max()), 0.0)
    return rows
