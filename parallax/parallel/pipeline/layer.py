"""A pipelined layer's traced body, run inside the pipeline as one device runs it.

Inside the pipeline's ``shard_map`` the stage axis is manual, where the layer was traced with it
automatic: :func:`in_context` rebinds the calls it records to the mesh it runs in. And its random
draws are made as one device makes them (:class:`Draws`).

A layer that draws random numbers per example (dropout) draws, on one device, the bits of the
whole batch from its key: ``random_bits(key, shape=(B, ...))``. The pipeline runs the layer on
a microbatch, traced at its shape: the same key would draw ``(mb, ...)`` bits, other numbers
than one device's. So the pipeline hands the layer its rows' indices in the batch, and
:class:`Draws` makes each such draw at the batch's shape and takes the microbatch's rows from
it: every mask is one device's (whatever the PRNG implementation), at the cost of drawing the
batch's bits once per microbatch. A draw whose shape does not depend on the batch (one number
per layer) is made as it is.

Example:
    >>> def layer(key, h):
    ...     return h * jax.random.bernoulli(key, 0.5, h.shape)
    >>> key, batch = jax.random.key(0), jnp.ones((4, 3))
    >>> full = jax.make_jaxpr(layer)(key, batch)
    >>> micro = jax.make_jaxpr(layer)(key, batch[:2])
    >>> per_example_draws(micro.jaxpr, full.jaxpr, 2, 4)
    (True,)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax.extend import core

from parallax.jaxpr.chains import CALLS, REMAT, sub_jaxprs

RANDOM_BITS = "random_bits"
# Calls opened to reach a draw inside them (a jax.checkpoint stays one, with its policy); a draw
# inside any other (a custom derivative, a loop, a branch) is refused.
OPENED = (*CALLS, *REMAT)


def in_context(jaxpr: Any, mesh: Any) -> Any:
    """``jaxpr`` with the mesh its calls record (``ctx_mesh``: the mesh in context when it was
    traced, where the stage axis was automatic) replaced by ``mesh``, the one it runs in (inside
    the pipeline, where the stage axis is manual), in every jaxpr nested in it."""

    def fix(value: Any) -> Any:
        if isinstance(value, core.ClosedJaxpr):
            return core.ClosedJaxpr(in_context(value.jaxpr, mesh), value.consts)
        if isinstance(value, core.Jaxpr):
            return in_context(value, mesh)
        if isinstance(value, tuple) and any(isinstance(v, (core.Jaxpr, core.ClosedJaxpr)) for v in value):
            return tuple(fix(v) for v in value)
        return value

    eqns = [eqn.replace(params={name: mesh if name == "ctx_mesh" and value is not None else fix(value)
                                for name, value in eqn.params.items()}) for eqn in jaxpr.eqns]
    return jaxpr.replace(eqns=eqns)


def layer_mesh(mesh: Any, axis: str) -> Any:
    """The mesh a layer is traced under: the one it runs in, the stage axis manual (a model that reads
    the mesh, to place its own ``shard_map``, sees the axes it may split), or none where the stage axis
    is the mesh's only one."""
    if mesh is None or set(mesh.axis_names) == {axis}:
        return jax.sharding.AbstractMesh((), ())
    return mesh.abstract_mesh.update_axis_types({axis: jax.sharding.AxisType.Manual})


def draw_shapes(jaxpr: Any) -> list[tuple[int, ...]]:
    """The shapes of ``jaxpr``'s random draws, nested ones included, in the order they run."""
    shapes = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == RANDOM_BITS:
            shapes.append(tuple(eqn.params["shape"]))
        for inner in sub_jaxprs(eqn):
            shapes += draw_shapes(inner)
    return shapes


def per_example_draws(micro: Any, full: Any, micro_rows: int, rows: int) -> tuple[bool, ...]:
    """Which of a layer's draws are per example: the layer traced on a microbatch of
    ``micro_rows`` rows (``micro``) and on the batch of ``rows`` (``full``), draw by draw.

    Raises:
        ValueError: a draw whose shape follows the batch other than by its leading dim.
    """
    pairs = list(zip(draw_shapes(micro), draw_shapes(full), strict=True))
    for small, whole in pairs:
        if small != whole and (small[:1] != (micro_rows,) or whole != (rows, *small[1:])):
            raise ValueError(
                f"The blocks draw random numbers of shape {whole} for the batch of {rows} rows (and {small} for a "
                f"microbatch of {micro_rows}): a pipeline draws per-example numbers as one device does only when the "
                "batch is their leading dim. Draw them with the batch first (e.g. jax.random.bernoulli(key, p, "
                "h.shape) on activations laid out [batch, ...]).")
    return tuple(small != whole for small, whole in pairs)


class Draws:
    """The draws of one run of a pipelined layer on a microbatch: which are per example, the
    microbatch's rows in the batch, and the batch's row count."""

    def __init__(self, per_example: Sequence[bool], rows: jax.Array, batch: int):
        self._flags: Iterator[bool] = iter(per_example)
        self.rows, self.batch = rows, batch

    def holds(self, eqn: Any) -> bool:
        """Whether ``eqn`` is, or holds, a draw."""
        return eqn.primitive.name == RANDOM_BITS or any(draw_shapes(inner) for inner in sub_jaxprs(eqn))

    def opens(self, eqn: Any) -> bool:
        """Whether ``eqn`` is a call to evaluate inline (it holds a draw the pipeline makes at the
        batch's shape); a draw inside a call it cannot open is refused by name."""
        if eqn.primitive.name == RANDOM_BITS or not self.holds(eqn):
            return False
        if eqn.primitive.name in OPENED:
            return True
        count = sum(len(draw_shapes(inner)) for inner in sub_jaxprs(eqn))
        if any([next(self._flags) for _ in range(count)]):  # noqa: C419 (every flag consumed)
            raise ValueError(
                f"The blocks draw random numbers per example inside a {eqn.primitive.name} (a loop, a branch or a "
                "custom derivative): a pipeline draws them as one device does only in the layer's own code. Draw "
                "them outside it (e.g. the dropout mask before the loop), or make the blocks deterministic.")
        return False

    def draw(self, eqn: Any, key: Any) -> Any:
        """The draw ``eqn`` makes on ``key``: at the batch's shape, the microbatch's rows taken, where
        it is per example."""
        params = dict(eqn.params)
        if not next(self._flags):
            return eqn.primitive.bind(key, **params)
        whole = eqn.primitive.bind(key, **{**params, "shape": (self.batch, *params["shape"][1:])})
        return jax.numpy.take(whole, self.rows, axis=0)


def layer_draws(micro: Any, full: Any, rows: int, microbatches: int) -> tuple[Callable[[list], Draws | None], list]:
    """How a pipelined layer (``micro``, traced on a microbatch; ``full``, on the batch of ``rows``)
    draws per example as one device does: a function of the per-example constants the layer is
    given (their last, where it draws so, the microbatch's rows in the batch) that returns its
    :class:`Draws`, and that extra constant, the rows' indices (neither where it draws nothing per
    example)."""
    flags = per_example_draws(getattr(micro, "jaxpr", micro), getattr(full, "jaxpr", full), rows // microbatches, rows)
    if not any(flags):
        return (lambda constants: None), []
    return (lambda constants: Draws(flags, constants[-1], rows)), [jax.numpy.arange(rows, dtype=jax.numpy.int32)]
