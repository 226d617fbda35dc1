"""What a Pallas kernel costs: the FLOPs of its matmuls and the device-memory bytes it moves.

A ``pallas_call`` runs its kernel once per cell of its grid; inside, a loop may run a number of
times read from the cell's index (a causal flash attention's inner loop stops at the diagonal).
Counted as the kernel's body once, as a plain jaxpr walk would, a flash attention of 8,192 tokens
costs the FLOPs of one tile of queries against one tile of keys. Here:

- each cell's body: its ``dot_general`` FLOPs, and for a Triton kernel (GPU), whose refs are
  device memory that every ``load`` reads and every ``swap`` writes, those bytes, with each loop
  run as many times as it runs for that cell (its bounds worked out from ``program_id``), and of a
  branch (``pl.when``) the one the cell takes; for a Mosaic kernel (TPU), whose blocks are copied
  in and out of on-chip memory, each block's bytes once per run of cells that keep its index (its
  pipeline skips the copy of an unchanged block).

A loop whose count depends on anything but the cell's index and constants is counted once (and
said in :attr:`KernelCost.unknown_loops`); such a kernel is priced by its own ``cost_estimate``
where its author gave one (``pl.CostEstimate``; the TPU flash attention's counts every tile, the
ones a causal mask skips included).

Example:
    >>> from jax.experimental.pallas.ops.gpu import attention
    >>> q = jnp.ones((1, 512, 1, 64), jnp.bfloat16)
    >>> jaxpr = jax.make_jaxpr(lambda q: attention.mha(q, q, q, segment_ids=None, causal=True))(q).jaxpr
    >>> call = next(kernel_calls(jaxpr))
    >>> cost = kernel_cost(call)
    >>> cost.flops == 4 * 64 * 128 * 128 * (1 + 2 + 3 + 4)  # 4 query tiles, each up to its diagonal
    True
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
from collections.abc import Iterator
from typing import Any

import numpy as np
from jax.extend import core as jcore

from parallax.jaxpr.chains import sub_jaxprs

__all__ = ["KernelCost", "kernel_calls", "kernel_cost", "kernel_flops", "value_bytes"]

_LOADS = frozenset({"load", "masked_load", "get"})
_STORES = frozenset({"swap", "masked_swap", "store"})
_MOST_CELLS = 1 << 16  # cells evaluated one by one; beyond, the first index of each read axis stands for all
_MOST_TRIPS = 1 << 20  # a loop simulated longer than this is counted once
_SCALAR_OPS = {
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "max": max, "min": min,
    "lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge, "eq": operator.eq, "ne": operator.ne,
    "and": operator.and_, "or": operator.or_, "neg": operator.neg,
    "div": lambda a, b: int(a / b) if isinstance(a, (int, np.integer)) else a / b,  # lax.div truncates integers
    "rem": lambda a, b: int(math.fmod(a, b)) if isinstance(a, (int, np.integer)) else math.fmod(a, b),
    "convert_element_type": lambda a: a, "multiple_of": lambda a: a,
    "select_n": lambda which, *cases: cases[int(which)],
}


@dataclasses.dataclass(frozen=True)
class KernelCost:
    """One ``pallas_call``'s cost, at the shapes it is called with.

    Attributes:
        flops: its matmuls' FLOPs over the grid.
        bytes: device-memory bytes read and written over the grid.
        unknown_loops: loops whose count could not be worked out (each counted once).
        estimated: whether the kernel's own ``cost_estimate`` gave the figures (its loops could not
            be worked out).
    """

    flops: float
    bytes: float
    unknown_loops: int = 0
    estimated: bool = False


def kernel_calls(jaxpr: Any) -> Iterator[Any]:
    """Every ``pallas_call`` equation in ``jaxpr``, inner jaxprs (calls, loops, custom rules) included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn
            continue
        for inner in sub_jaxprs(eqn):
            yield from kernel_calls(inner)


def kernel_cost(eqn: Any) -> KernelCost:
    """The FLOPs and bytes of one ``pallas_call`` equation (see the module)."""
    return _estimated(eqn, _walked(eqn, copies=True))


def kernel_flops(eqn: Any) -> float:
    """``kernel_cost(eqn).flops``, without working out where a Mosaic kernel's blocks are copied."""
    return _estimated(eqn, _walked(eqn, copies=False)).flops


def _estimated(eqn: Any, walked: KernelCost) -> KernelCost:
    """``walked``, or the kernel's own ``cost_estimate`` where its loops could not be worked out."""
    estimate = eqn.params.get("cost_estimate")
    if walked.unknown_loops and estimate is not None:
        return KernelCost(float(estimate.flops), float(estimate.bytes_accessed), walked.unknown_loops, estimated=True)
    return walked


def _walked(eqn: Any, copies: bool) -> KernelCost:
    """The kernel walked cell by cell; ``copies=False`` leaves a Mosaic kernel's bytes at 0."""
    mapping, body = eqn.params["grid_mapping"], eqn.params["jaxpr"]
    grid = tuple(int(size) if isinstance(size, (int, np.integer)) else 1 for size in mapping.grid)
    cells = math.prod(grid)
    triton = "triton" in type(eqn.params.get("compiler_params")).__module__
    read = sorted(_program_axes(body))
    enumerated = math.prod(grid[a] for a in read)
    if enumerated > _MOST_CELLS:
        read, enumerated = [], 1
    flops = moved = 0.0
    unknown = 0
    for index in itertools.product(*(range(grid[a]) for a in read)):
        f, b, u = _walk(body, _Scalars(dict(zip(read, index)), grid), triton)
        flops, moved, unknown = flops + f, moved + b, max(unknown, u)
    scale = cells / enumerated
    if triton:
        moved *= scale
    elif copies:  # Mosaic: a block copied in (or out) where its index changes from one cell to the next
        moved = float(sum(_block_bytes(m) * _copies(m, grid) for m in mapping.block_mappings))
    return KernelCost(flops * scale, moved, unknown)


def _copies(mapping: Any, grid: tuple[int, ...]) -> int:
    """How many times a Mosaic kernel's pipeline copies this block: once per run of cells (the last
    grid axis fastest) that keep its index, as it skips the copy of an unchanged block; every cell
    where its index cannot be worked out here, or the grid is too large to walk."""
    cells = math.prod(grid)
    if cells > _MOST_CELLS:
        return cells
    closed, scalars = mapping.index_map_jaxpr, _Scalars({}, grid)
    unknown = [None] * (len(closed.jaxpr.invars) - len(grid))  # scalar-prefetch operands: not known here
    copies, last = 0, None
    for index in itertools.product(*(range(size) for size in grid)):
        block = _run(closed, list(index) + unknown, scalars)
        if any(b is None for b in block):
            return cells
        copies += block != last
        last = block
    return copies


def _block_bytes(mapping: Any) -> int:
    aval = getattr(mapping, "array_aval", None)
    shape = [getattr(b, "block_size", 1) if b is not None else 1 for b in mapping.block_shape]
    return int(np.prod(shape)) * (aval.dtype.itemsize if aval is not None else 4)


def _program_axes(jaxpr: Any) -> set[int]:
    """The grid axes whose index the kernel reads (anywhere in it)."""
    axes = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "program_id":
            axes.add(int(eqn.params["axis"]))
        for inner in sub_jaxprs(eqn):
            axes |= _program_axes(inner)
    return axes


@dataclasses.dataclass
class _Scalars:
    """The scalar values known in one cell: its grid index, and what follows from it and constants."""
    index: dict[int, int]
    grid: tuple[int, ...]
    known: dict = dataclasses.field(default_factory=dict)

    def value(self, var: Any) -> Any:
        if isinstance(var, jcore.Literal):
            return var.val if np.ndim(var.val) == 0 else None
        return self.known.get(var)

    def step(self, eqn: Any) -> None:
        name = eqn.primitive.name
        if name == "program_id":
            self.known[eqn.outvars[0]] = self.index.get(int(eqn.params["axis"]), 0)
        elif name == "num_programs":
            self.known[eqn.outvars[0]] = self.grid[int(eqn.params["axis"])]
        elif name in _SCALAR_OPS and len(eqn.outvars) == 1 and not getattr(eqn.outvars[0].aval, "shape", (1,)):
            args = [self.value(v) for v in eqn.invars]
            if all(a is not None for a in args):
                try:
                    self.known[eqn.outvars[0]] = _SCALAR_OPS[name](*(a.item() if hasattr(a, "item") else a
                                                                    for a in args))
                except (ArithmeticError, IndexError, TypeError, ValueError):
                    pass


def value_bytes(var: Any) -> int:
    """The bytes of a jaxpr value (0 for one without a shaped type: a token, a ref's effect)."""
    aval = getattr(var, "aval", None)
    try:
        return int(np.prod(aval.shape)) * aval.dtype.itemsize
    except (AttributeError, TypeError):
        return 0


def _walk(jaxpr: Any, scalars: _Scalars, triton: bool) -> tuple[float, float, int]:
    """One run of ``jaxpr`` in a cell: ``(flops, bytes, loops not worked out)``."""
    flops = moved = 0.0
    unknown = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        scalars.step(eqn)
        if name == "dot_general":
            (contracting, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            flops += 2.0 * float(np.prod(eqn.outvars[0].aval.shape)) * float(np.prod([lhs[d] for d in contracting]))
        elif triton and (name in _LOADS or name in _STORES):  # a load's value, or a swap's (its old one's size)
            moved += value_bytes(eqn.outvars[0])
        elif name == "cond":  # the branch this cell takes (pl.when), else the dearest
            which = scalars.value(eqn.invars[0])
            branches = eqn.params["branches"]
            costs = [_walk(b.jaxpr, _Scalars(scalars.index, scalars.grid), triton) for b in branches]
            f, b, u = (costs[int(np.clip(which, 0, len(costs) - 1))] if which is not None
                       else max(costs, key=lambda c: (c[0], c[1])))
            flops, moved, unknown = flops + f, moved + b, unknown + u
        elif name in ("scan", "while"):
            trips = int(eqn.params["length"]) if name == "scan" else _trips(eqn, scalars)
            body = eqn.params["jaxpr" if name == "scan" else "body_jaxpr"].jaxpr
            f, b, u = _walk(body, _Scalars(scalars.index, scalars.grid), triton)
            unknown += u + (trips is None)
            trips = 1 if trips is None else trips
            flops, moved = flops + f * trips, moved + b * trips
        elif inner := sub_jaxprs(eqn):  # a call: its first body (a custom rule's primal)
            f, b, u = _walk(inner[0], _Scalars(scalars.index, scalars.grid), triton)
            flops, moved, unknown = flops + f, moved + b, unknown + u
    return flops, moved, unknown


def _trips(eqn: Any, scalars: _Scalars) -> int | None:
    """How many times a ``while`` runs in this cell: its scalar carry stepped through its condition
    and body (a ``fori_loop``'s index against its bound); ``None`` where they read anything else."""
    cond, body = eqn.params["cond_jaxpr"], eqn.params["body_jaxpr"]
    nc, nb = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    cond_consts = [scalars.value(v) for v in eqn.invars[:nc]]
    body_consts = [scalars.value(v) for v in eqn.invars[nc:nc + nb]]
    carry = [scalars.value(v) for v in eqn.invars[nc + nb:]]
    for trips in range(_MOST_TRIPS):
        going = _run(cond, cond_consts + carry, scalars)[0]
        if going is None:
            return None
        if not going:
            return trips
        carry = _run(body, body_consts + carry, scalars)
    return None


def _run(closed: Any, args: list, scalars: _Scalars) -> list:
    """The scalar outputs of ``closed`` on ``args`` (``None`` where unknown)."""
    inner = _Scalars(scalars.index, scalars.grid)
    jaxpr = closed.jaxpr
    inner.known.update({v: c for v, c in zip(jaxpr.constvars, closed.consts) if np.ndim(c) == 0})
    inner.known.update({v: a for v, a in zip(jaxpr.invars, args) if a is not None})
    for eqn in jaxpr.eqns:
        inner.step(eqn)
    return [inner.value(v) for v in jaxpr.outvars]
