"""The device-memory bytes a step moves, read from its jaxpr as a GPU compiler fuses it.

A compiled program's ``bytes accessed`` depends on how its backend fuses: planned on this CPU for
a GPU, the CPU compiler's count is the CPU's (it converts bf16 around each op and fuses less). This
count does not depend on the backend that compiled the plan: in the step's jaxpr, elementwise
ops (and the reductions that consume them) are grouped as XLA's GPU and TPU compilers fuse them,
each group reads the values it takes from outside once and writes what leaves it once; a matmul,
a gather, a collective or a loop reads materialised inputs and writes its outputs (a
``dynamic_slice`` reads its slice alone, a ``dynamic_update_slice`` writes its update alone, in
place, as a loop's accumulator is written, and a slice's gradient added to an accumulator is that
update read and written, as XLA rewrites it); a scan's body counts once per iteration; a Pallas
kernel, what its loads and stores move over its grid (:mod:`parallax.pricing.kernel_cost`). Measured
against an H200 (``benchmarks/results/gpu.md``): the step times this predicts are within 7 %
(float32) and 21 % (bf16) of the measured ones. The jaxpr's matmuls too: their FLOPs, every loop
iteration's (:func:`dot_flops`), and the dtype most of them run in (:func:`matmul_dtype`).

Example:
    >>> jaxpr = jax.make_jaxpr(lambda x: jnp.exp(x * 2).sum())(jnp.ones((1024,), jnp.float32))
    >>> fused_bytes(jaxpr.jaxpr).total  # x read once; the sum's 4 bytes written
    4100.0
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import numpy as np
from jax.extend import core as jcore

from parallax.jaxpr.chains import sub_jaxprs
from parallax.pricing.kernel_cost import kernel_cost, kernel_flops, value_bytes

__all__ = ["Moved", "dot_flops", "fused_bytes", "matmul_dtype"]

_ELEMENTWISE = frozenset(["abs", "add", "and", "atan2", "broadcast_in_dim", "ceil", "clamp", "convert_element_type",
                          "copy", "copy_p", "cos", "cumsum", "cummax", "cumlogsumexp", "div", "eq", "erf", "erf_inv",
                          "erfc", "exp", "exp2", "expand_dims", "floor", "ge", "gt", "integer_pow", "iota", "is_finite",
                          "le", "log", "log1p", "logistic", "lt", "max", "mesh_cast", "min", "mul", "ne", "neg",
                          "nextafter", "not", "or", "pow", "pvary", "random_bits", "random_unwrap", "random_wrap",
                          "reduce_precision", "rem", "reshape", "reshard", "round", "rsqrt", "select_n",
                          "sharding_constraint", "shift_left", "shift_right_arithmetic", "shift_right_logical", "sign",
                          "sin", "sqrt", "square", "squeeze", "stop_gradient", "sub", "tan", "tanh", "threefry2x32",
                          "transpose", "xor"])
_REDUCTIONS = frozenset(["argmax", "argmin", "reduce_and", "reduce_max", "reduce_min", "reduce_or", "reduce_prod",
                         "reduce_sum"])


@dataclasses.dataclass(frozen=True)
class Moved:
    """Bytes of device memory one run of a jaxpr reads and writes.

    Attributes:
        total: all of them.
        state: of them, those of values shaped like a leaf of the train state (params, gradients,
            optimizer state): what a sharded state divides.
        local: of them, those inside a ``shard_map``'s body, whose shapes are one device's already.
    """

    total: float = 0.0
    state: float = 0.0
    local: float = 0.0

    def __add__(self, other: Moved) -> Moved:
        return Moved(self.total + other.total, self.state + other.state, self.local + other.local)

    def times(self, count: float) -> Moved:
        return Moved(self.total * count, self.state * count, self.local * count)

    def per_device(self, devices: int, state_fraction: float) -> float:
        """One device's bytes: the state's by the fraction a device holds, a ``shard_map`` body's as
        they are, the rest (activations at the jaxpr's global shapes) split over the devices."""
        return self.state * state_fraction + self.local + (self.total - self.state - self.local) / max(devices, 1)


def _runs(eqn: Any) -> int:
    return int(eqn.params.get("length", 1)) if eqn.primitive.name == "scan" else 1


def fused_bytes(jaxpr: Any, state_shapes: Iterable[tuple[int, ...]] = ()) -> Moved:
    """The bytes ``jaxpr`` (a ``jax.extend.core.Jaxpr``) reads and writes, fused (see the module);
    ``state_shapes``: the train state's leaves' shapes, whose bytes :attr:`Moved.state` counts."""
    shapes = frozenset(tuple(s) for s in state_shapes)
    producer, consumers = {}, {}
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            producer[var] = eqn
        for var in eqn.invars:
            if isinstance(var, jcore.Var):
                consumers.setdefault(var, []).append(eqn)
    outputs = {var for var in jaxpr.outvars if isinstance(var, jcore.Var)}

    def fusible(eqn: Any) -> bool:
        return eqn.primitive.name in _ELEMENTWISE and not sub_jaxprs(eqn)

    def materialised(var: Any) -> bool:
        made = producer.get(var)
        if made is None or not fusible(made) or var in outputs:
            return True
        return any(not (fusible(c) or c.primitive.name in _REDUCTIONS) for c in consumers.get(var, []))

    def only_added(eqn: Any) -> bool:  # its result read by additions alone (an accumulator's)
        return all(c.primitive.name in ("add", "add_any") for c in consumers.get(eqn.outvars[0], []))

    group = {id(eqn): id(eqn) for eqn in jaxpr.eqns}

    def root(key: int) -> int:
        while group[key] != key:
            group[key] = group[group[key]]
            key = group[key]
        return key

    for var, made in producer.items():
        if not materialised(var):  # fused into each consumer: one group
            for consumer in consumers.get(var, []):
                group[root(id(consumer))] = root(id(made))

    def moved(var: Any) -> Moved:
        size = value_bytes(var)
        return Moved(size, size if tuple(getattr(var.aval, "shape", ())) in shapes else 0)

    total, reads = Moved(), {}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":  # a kernel: its loads and stores over its grid
            total = total + Moved(kernel_cost(eqn).bytes)
            continue
        inner = sub_jaxprs(eqn)
        if inner:  # a call, a remat, a scan's body (once per iteration), a shard_map's body
            body = max((fused_bytes(j, shapes) for j in inner), key=lambda m: m.total).times(_runs(eqn))
            if eqn.primitive.name == "shard_map":  # one device's: its shapes are one manual shard's, over the rest
                mine = body.total / _sharing(eqn)
                body = Moved(mine, 0.0, mine)
            total = total + body
            continue
        if eqn.primitive.name == "dynamic_update_slice":  # in place (a loop's accumulator): the update alone
            update = eqn.invars[1]
            total = total + moved(update)
            if isinstance(update, jcore.Var) and materialised(update):
                reads.setdefault(root(id(eqn)), set()).add(update)
            continue
        if eqn.primitive.name == "dynamic_slice":  # reads its slice alone (a loop's step of a sequence)
            total = total + moved(eqn.outvars[0]).times(2 if materialised(eqn.outvars[0]) else 1)
            continue
        padded = next((producer.get(v) for v in eqn.invars
                       if isinstance(v, jcore.Var) and _zero_padded(producer.get(v), producer)), None)
        if eqn.primitive.name in ("add", "add_any") and padded is not None:
            total = total + moved(padded.invars[1]).times(2)  # a slice's gradient added in place: read, written
            continue
        for var in eqn.outvars:
            padding = consumers.get(var, []) and all(_zero_padded(c, producer) and only_added(c)
                                                     for c in consumers.get(var, []))
            if not isinstance(var, jcore.DropVar) and materialised(var) and not padding:  # zeros an update is
                total = total + moved(var)  # added in place of: never written
        for var in eqn.invars:
            if isinstance(var, jcore.Var) and materialised(var):
                reads.setdefault(root(id(eqn)), set()).add(var)
    for read in reads.values():
        for var in read:
            total = total + moved(var)
    return total


def _zero_padded(eqn: Any, producer: dict) -> bool:
    """Whether ``eqn`` writes an update into a scalar broadcast (a slice's gradient, into zeros): added
    to an accumulator, XLA adds the update in place (``add(acc, dynamic_update_slice(0, u, i))`` becomes
    an update of ``acc``)."""
    if eqn is None or eqn.primitive.name != "dynamic_update_slice" or not isinstance(eqn.invars[0], jcore.Var):
        return False
    base = producer.get(eqn.invars[0])  # zeros: a scalar broadcast (a transpose's zeros, a literal or a traced 0)
    return (base is not None and base.primitive.name == "broadcast_in_dim"
            and not getattr(base.invars[0].aval, "shape", 1))


def _sharing(eqn: Any) -> int:
    """How many devices share one body of a ``shard_map`` equation: its shapes are one shard's along
    its manual axes, and whole along the mesh's others (a pipeline's body: manual over the stages
    only, the FSDP and tensor axes still automatic inside it)."""
    mesh = eqn.params.get("mesh")
    manual = eqn.params.get("newly_manual_axes", eqn.params.get("manual_axes"))
    if mesh is None or not manual:
        return 1
    return max(int(mesh.size) // int(np.prod([mesh.shape[a] for a in manual])), 1)


def dot_flops(jaxpr: Any) -> tuple[float, float]:
    """The FLOPs of ``jaxpr``'s matmuls (``dot_general``; a scan's body once per iteration, a Pallas
    kernel's over its grid):
    ``(at global shapes, inside shard_map bodies at one device's)`` (a body manual over some axes
    only is divided over the devices of the others, which its shapes span)."""
    whole = local = 0.0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":  # a kernel: its matmuls over its grid
            whole += kernel_flops(eqn)
            continue
        inner = sub_jaxprs(eqn)
        if inner:
            body = max((dot_flops(j) for j in inner), key=sum)
            runs = _runs(eqn)
            if eqn.primitive.name == "shard_map":
                local += runs * sum(body) / _sharing(eqn)
            else:
                whole, local = whole + runs * body[0], local + runs * body[1]
        elif eqn.primitive.name == "dot_general":
            (contracting, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            whole += 2.0 * float(np.prod(eqn.outvars[0].aval.shape)) * float(np.prod([lhs[d] for d in contracting]))
    return whole, local


_WIDTHS = {"bfloat16": ("bf16", 16), "float16": ("fp16", 16), "float32": ("fp32", 32), "float64": ("fp32", 64),
           "int8": ("fp8", 8)}


def matmul_dtype(jaxpr: Any, default: str = "fp32") -> str:
    """The compute dtype most of ``jaxpr``'s matmuls run in: each ``dot_general``'s narrowest operand
    (the jaxpr's, before a backend converts them).

    Example:
        >>> bf16 = jnp.ones((4, 8), jnp.bfloat16)
        >>> matmul_dtype(jax.make_jaxpr(lambda a: a @ a.T)(bf16).jaxpr)
        'bf16'
    """
    votes: dict[str, int] = {}

    def walk(inner: Any) -> None:
        for eqn in inner.eqns:
            for body in sub_jaxprs(eqn):
                walk(body)
            if eqn.primitive.name == "dot_general":
                kinds = [str(var.aval.dtype) for var in eqn.invars]
                known = [_WIDTHS[k] for k in kinds if k in _WIDTHS]
                name = ("fp8" if any(k.startswith("float8") for k in kinds)
                        else min(known, key=lambda pair: pair[1])[0] if known else default)
                votes[name] = votes.get(name, 0) + 1

    walk(jaxpr)
    return max(votes, key=votes.get) if votes else default
