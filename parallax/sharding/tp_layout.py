"""A Megatron tensor-parallel layout read from the computation, not from layer names.

The loss is traced once with ``jax.make_jaxpr``. Every dim of every value in the trace is
a node; the ops tie nodes that must be split together:

* elementwise ops, broadcasts, transposes and layout-preserving reshapes tie a dim of
  the result to the dim of each operand it comes from (a ``(B, T, H*D) -> (B, T, H, D)``
  reshape ties ``H*D`` to ``H``: cutting ``H*D`` into equal blocks is cutting ``H``);
* a matmul (``dot_general``) or a convolution ties its operands' contracted dims to
  each other, a batch dim of both operands to the result's, and every other dim of an
  operand to the result's;
* calls into sub-computations (``jit``, ``remat``, ``custom_vjp``, ``scan``, ``while``,
  ``cond``) tie their arguments and results to the inner computation's.

A connected set of tied dims (a *class*) can be split over the tensor axis as a whole:
every array in it then holds ``1/n`` of that dim, and the only communication is where
the class ends. A class ends where it is contracted or reduced (an all-reduce of the
result: the row-parallel end of a Megatron pair) or consumed by an op that needs the whole
dim (an all-gather), and where it begins from a value that needs a gradient (an
all-reduce of that gradient: the column-parallel start). In an MLP ``x -> W1 -> act ->
W2`` the hidden dim is one class holding ``W1``'s output dim and ``W2``'s input dim, so
splitting it is Megatron's column/row pair; attention heads are one class from the
``q``/``k``/``v`` kernels through the batched score and value matmuls to the output
kernel; an embedding table's vocabulary is a class that a lookup ends.

Classes are chosen greedily by param bytes split per byte communicated, skipping a class
that would split a second dim of an array some chosen class already splits, that has a
dim the axis size does not divide, or that holds the batch dim or a scanned layer dim.
The layout is only about speed: whatever is chosen, the compiler inserts the collectives,
so the result is the same as on one device.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping, Sequence

import numpy as np
from jax.extend import core

from parallax._compat import scan_counts

__all__ = ["ParamLayout", "TensorLayout", "derive_layout", "scanned_dims"]

_REDUCTIONS = {
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor",
    "argmax", "argmin",
}
_CUMULATIVE = {"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"}
_WINDOWED = {"reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window",
             "select_and_gather_add", "select_and_scatter_add"}
_NOT_ELEMENTWISE = {
    "fft", "triangular_solve", "cholesky", "lu", "qr", "eigh", "eig", "svd", "schur", "custom_linear_solve",
    "linear_solve", "tridiagonal", "tridiagonal_solve", "householder_product", "rng_bit_generator",
    "scatter", "scatter-add", "scatter_add", "scatter_mul", "scatter_min", "scatter_max",
}
_CALL_JAXPR_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """Where one param goes on the tensor axis, and why.

    Attributes:
        path: the param's path, e.g. ``"Dense_0/kernel"``.
        shape: its shape.
        dim: the dim split over the tensor axis, or ``None`` (replicated over it).
        role: ``"column"`` (an output dim of its matmul), ``"row"`` (a contracted dim),
            ``"vocab"`` (the dim a lookup indexes), ``"elementwise"`` (a bias or scale
            following its class), ``"rule"`` / ``"annotation"`` (placed by a name rule or
            the model's own annotation), or ``""`` when not split.
        reason: one line saying why it is split this way, or why it is not split.
    """

    path: str
    shape: tuple[int, ...]
    dim: int | None
    role: str
    reason: str


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """The tensor-parallel layout derived from a model's computation.

    Attributes:
        axis: the tensor mesh axis.
        axis_size: its size.
        params: one :class:`ParamLayout` per param, in the params' order.
    """

    axis: str
    axis_size: int
    params: tuple[ParamLayout, ...]

    @functools.cached_property
    def _dims(self) -> dict[str, int | None]:
        return {entry.path: entry.dim for entry in self.params}

    def dim_of(self, path: str) -> int | None:
        """The dim of ``path`` split over the tensor axis (``None``: not split or unknown)."""
        return self._dims.get(path)

    @property
    def split_fraction(self) -> float:
        """The fraction of param elements in params split over the tensor axis."""
        total = sum(math.prod(p.shape) for p in self.params)
        split = sum(math.prod(p.shape) for p in self.params if p.dim is not None)
        return split / total if total else 0.0

    def describe(self) -> str:
        """A table: every param, its shape, the dim split over the axis and why.

        Example:
            >>> print(layout.describe())  # doctest: +SKIP
            tensor-parallel layout over 'tensor' (size 2): 4 of 6 params split, 99.4% of param elements
              Dense_0/kernel  (64, 256)  dim 1  column  hidden dim (256) ...
        """
        split = sum(p.dim is not None for p in self.params)
        lines = [
            f"tensor-parallel layout over {self.axis!r} (size {self.axis_size}): {split} of "
            f"{len(self.params)} params split, {100 * self.split_fraction:.1f}% of param elements"
        ]
        width = max((len(p.path) for p in self.params), default=0)
        shape_width = max((len(str(p.shape)) for p in self.params), default=0)
        for p in self.params:
            where = f"dim {p.dim}" if p.dim is not None else "whole"
            lines.append(f"  {p.path:<{width}}  {str(p.shape):<{shape_width}}  {where:<6} {p.role or '-':<11} {p.reason}")
        return "\n".join(lines)

    def unsplit_reasons(self, limit: int = 5) -> list[str]:
        """Why the largest unsplit params are not split (``path: reason``), largest first."""
        unsplit = sorted((p for p in self.params if p.dim is None), key=lambda p: -math.prod(p.shape))
        return [f"{p.path} {p.shape}: {p.reason}" for p in unsplit[:limit]]


# --- the graph of tied dims ------------------------------------------------------------------


class _Val:
    """One value of one call: a sub-computation called twice (a shared ``jit``) has two."""

    __slots__ = ("shape", "dtype", "__weakref__")

    def __init__(self, shape: tuple[int, ...], dtype: Any):
        self.shape = shape
        self.dtype = dtype


def _shape(val: Any) -> tuple[int, ...] | None:
    return val.shape if isinstance(val, _Val) else None


def _nbytes(val: Any) -> int:
    if not isinstance(val, _Val):
        return 0
    try:
        itemsize = np.dtype(val.dtype).itemsize
    except TypeError:
        itemsize = 4
    return math.prod(val.shape) * itemsize


def _is_var(x: Any) -> bool:
    return isinstance(x, _Val)


def _val(env: dict, var: Any) -> _Val | None:
    """The value of ``var`` in this call (literals and shapeless values: ``None``)."""
    if isinstance(var, core.Literal):
        return None
    found = env.get(var)
    if found is None:
        shape = getattr(getattr(var, "aval", None), "shape", None)
        if shape is None:
            return None
        found = env[var] = _Val(tuple(shape), var.aval.dtype)
    return found


@dataclasses.dataclass
class _Eqn:
    """An op as the cost model sees it: the values in and out and the dims it reduces."""

    name: str
    invars: list
    outvars: list
    reduced: set  # nodes (var, dim) of invars contracted or reduced (their class ends in an all-reduce)
    weight: int  # how many times it runs (scan length)


class _Graph:
    def __init__(self):
        self.parent: dict = {}
        self.size: dict = {}
        self.forbidden: dict = {}  # node -> why its class must not be split
        self.eqns: list[_Eqn] = []
        self.needs_grad: set = set()  # vars (by id) that depend on a param
        self.vars: dict = {}  # id -> var, every var with nodes
        self.origin: dict = {}  # id(var) -> (param index, {var dim: param dim})
        self.roles: dict = {}  # (param index, param dim) -> set of roles

    # union-find over nodes (id(var), dim)
    def add(self, var: Any) -> None:
        if id(var) in self.vars:
            return
        self.vars[id(var)] = var
        for dim, size in enumerate(_shape(var)):
            node = (id(var), dim)
            self.parent[node] = node
            self.size[node] = size

    def find(self, node):
        root = node
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[node] != root:
            self.parent[node], node = root, self.parent[node]
        return root

    def tie(self, a: Any, dim_a: int, b: Any, dim_b: int) -> None:
        if not (_is_var(a) and _is_var(b)):
            return
        self.add(a)
        self.add(b)
        if _shape(a)[dim_a] <= 1 or _shape(b)[dim_b] <= 1:
            return
        ra, rb = self.find((id(a), dim_a)), self.find((id(b), dim_b))
        if ra != rb:
            self.parent[ra] = rb

    def tie_all(self, a: Any, b: Any) -> None:
        if _is_var(a) and _is_var(b) and len(_shape(a)) == len(_shape(b)):
            for d in range(len(_shape(a))):
                self.tie(a, d, b, d)

    def forbid(self, var: Any, dim: int, why: str) -> None:
        if _is_var(var):
            self.add(var)
            self.forbidden.setdefault((id(var), dim), why)

    def note_role(self, var: Any, dim: int, role: str) -> None:
        found = self.origin.get(id(var)) if _is_var(var) else None
        if found is not None and dim in found[1]:
            self.roles.setdefault((found[0], found[1][dim]), set()).add(role)

    def pass_origin(self, src: Any, dst: Any, dim_map: Mapping[int, int]) -> None:
        """``dst`` is ``src`` re-laid out: ``dst`` dim ``d`` is ``src`` dim ``dim_map[d]``."""
        found = self.origin.get(id(src)) if _is_var(src) else None
        if found is not None and _is_var(dst):
            self.origin[id(dst)] = (found[0], {d: found[1][s] for d, s in dim_map.items() if s in found[1]})


def _reshape_ties(graph: _Graph, src: Any, dst: Any) -> None:
    """Ties the major dim of each group of dims a reshape merges or splits."""
    a, b = _shape(src), _shape(dst)
    if 0 in a or 0 in b:
        return
    i = j = 0
    while i < len(a) and j < len(b):
        group_a, group_b = [i], [j]
        pa, pb = a[i], b[j]
        while pa != pb:
            if pa < pb:
                i += 1
                if i >= len(a):
                    return
                group_a.append(i)
                pa *= a[i]
            else:
                j += 1
                if j >= len(b):
                    return
                group_b.append(j)
                pb *= b[j]
        major_a = next((d for d in group_a if a[d] > 1), None)
        major_b = next((d for d in group_b if b[d] > 1), None)
        if major_a is not None and major_b is not None:
            graph.tie(src, major_a, dst, major_b)
            if len(group_a) == 1 and len(group_b) == 1:
                graph.pass_origin(src, dst, {major_b: major_a})
        i += 1
        j += 1


def _sub_jaxpr(eqn: Any):
    for key in _CALL_JAXPR_PARAMS:
        sub = eqn.params.get(key)
        if sub is None:
            continue
        jaxpr = sub.jaxpr if isinstance(sub, core.ClosedJaxpr) else sub
        if isinstance(jaxpr, core.Jaxpr) and len(jaxpr.invars) == len(eqn.invars) and len(jaxpr.outvars) == len(eqn.outvars):
            return jaxpr
    return None


def _inner(closed: Any):
    return closed.jaxpr if isinstance(closed, core.ClosedJaxpr) else closed


def _walk(graph: _Graph, jaxpr: Any, env: dict, weight: int) -> None:
    for eqn in jaxpr.eqns:
        _visit(graph, eqn, env, weight)


def _link_in(graph: _Graph, outer_in: Sequence, inner_in: Sequence) -> None:
    for outer, inner in zip(outer_in, inner_in):
        graph.tie_all(outer, inner)
        if _is_var(outer) and _is_var(inner):
            graph.pass_origin(outer, inner, {d: d for d in range(len(_shape(inner)))})
            if id(outer) in graph.needs_grad:
                graph.needs_grad.add(id(inner))


def _link_out(graph: _Graph, inner_out: Sequence, outer_out: Sequence) -> None:
    for inner, outer in zip(inner_out, outer_out):
        graph.tie_all(inner, outer)
        if _is_var(inner) and _is_var(outer) and id(inner) in graph.needs_grad:
            graph.needs_grad.add(id(outer))


def _call(graph: _Graph, jaxpr: Any, outer_in: Sequence, outer_out: Sequence, weight: int) -> tuple[list, list]:
    """Walks a sub-computation with fresh values, tied to the caller's; returns its invars and outvars."""
    env: dict = {}
    inner_in = [_val(env, v) for v in jaxpr.invars]
    _link_in(graph, outer_in, inner_in)
    _walk(graph, jaxpr, env, weight)
    inner_out = [_val(env, v) for v in jaxpr.outvars]
    _link_out(graph, inner_out, outer_out)
    return inner_in, inner_out


def _visit(graph: _Graph, eqn: Any, env: dict, weight: int) -> None:
    name = eqn.primitive.name
    invars = [_val(env, v) for v in eqn.invars]
    outvars = [_val(env, v) for v in eqn.outvars]
    ins = [v for v in invars if _is_var(v)]
    outs = [v for v in outvars if _is_var(v)]
    for v in ins + outs:
        graph.add(v)
    if any(id(v) in graph.needs_grad for v in ins):
        for v in outs:
            if np.issubdtype(v.dtype, np.floating):
                graph.needs_grad.add(id(v))
    reduced: set = set()
    params = eqn.params

    if name == "scan":
        _scan(graph, eqn, invars, outvars, weight)
        return
    if name == "while":
        cond, body = _inner(params["cond_jaxpr"]), _inner(params["body_jaxpr"])
        nc, nb = params["cond_nconsts"], params["body_nconsts"]
        carry = invars[nc + nb:]
        body_in, body_out = _call(graph, body, invars[nc:nc + nb] + carry, outvars, weight)
        for inner_in, inner_out in zip(body_in[nb:], body_out):
            graph.tie_all(inner_in, inner_out)
        _call(graph, cond, invars[:nc] + carry, [], weight)
        return
    if name == "cond":
        for branch in params["branches"]:
            _call(graph, _inner(branch), invars[1:], outvars, weight)
        return
    sub = _sub_jaxpr(eqn)
    if sub is not None:
        _call(graph, sub, invars, outvars, weight)
        return

    out = outvars[0] if outvars else None
    if name == "dot_general":
        (lc, rc), (lb, rb) = params["dimension_numbers"]
        lhs, rhs = invars
        lhs_free = [d for d in range(len(_shape(lhs))) if d not in lc and d not in lb]
        rhs_free = [d for d in range(len(_shape(rhs))) if d not in rc and d not in rb]
        for k, (dl, dr) in enumerate(zip(lb, rb)):
            graph.tie(lhs, dl, out, k)
            graph.tie(rhs, dr, out, k)
        for k, d in enumerate(lhs_free):
            graph.tie(lhs, d, out, len(lb) + k)
            graph.note_role(lhs, d, "column")
        for k, d in enumerate(rhs_free):
            graph.tie(rhs, d, out, len(lb) + len(lhs_free) + k)
            graph.note_role(rhs, d, "column")
        for dl, dr in zip(lc, rc):
            graph.tie(lhs, dl, rhs, dr)
            graph.note_role(lhs, dl, "row")
            graph.note_role(rhs, dr, "row")
            reduced.update({(id(lhs), dl), (id(rhs), dr)} if _is_var(lhs) and _is_var(rhs) else set())
    elif name == "conv_general_dilated":
        lhs, rhs = invars
        lhs_spec, rhs_spec, out_spec = params["dimension_numbers"]
        graph.tie(lhs, lhs_spec[0], out, out_spec[0])
        graph.tie(rhs, rhs_spec[0], out, out_spec[1])
        graph.note_role(rhs, rhs_spec[0], "column")
        if params.get("feature_group_count", 1) == 1 and params.get("batch_group_count", 1) == 1:
            graph.tie(lhs, lhs_spec[1], rhs, rhs_spec[1])
            graph.note_role(rhs, rhs_spec[1], "row")
            if _is_var(lhs) and _is_var(rhs):
                reduced.update({(id(lhs), lhs_spec[1]), (id(rhs), rhs_spec[1])})
        elif params.get("batch_group_count", 1) == 1:
            graph.tie(lhs, lhs_spec[1], out, out_spec[1])  # grouped/depthwise: groups follow the channels
    elif name in _REDUCTIONS:
        axes = tuple(params["axes"])
        kept = [d for d in range(len(_shape(invars[0]))) if d not in axes]
        for k, d in enumerate(kept):
            graph.tie(invars[0], d, out, k)
        if _is_var(invars[0]):
            reduced.update((id(invars[0]), d) for d in axes)
    elif name == "broadcast_in_dim":
        src = invars[0]
        if _is_var(src):
            for k, d in enumerate(params["broadcast_dimensions"]):
                if _shape(src)[k] == _shape(out)[d]:
                    graph.tie(src, k, out, d)
            graph.pass_origin(src, out, {d: k for k, d in enumerate(params["broadcast_dimensions"])})
    elif name == "reshape":
        if _is_var(invars[0]):
            _reshape_ties(graph, invars[0], out)
    elif name == "transpose":
        perm = params["permutation"]
        for k, d in enumerate(perm):
            graph.tie(invars[0], d, out, k)
        graph.pass_origin(invars[0], out, {k: d for k, d in enumerate(perm)})
    elif name == "squeeze":
        src = invars[0]
        kept = [d for d in range(len(_shape(src))) if d not in params["dimensions"]]
        for k, d in enumerate(kept):
            graph.tie(src, d, out, k)
        graph.pass_origin(src, out, {k: d for k, d in enumerate(kept)})
    elif name == "concatenate":
        axis = params["dimension"]
        for src in invars:
            for d in range(len(_shape(out))):
                if d != axis:
                    graph.tie(src, d, out, d)
    elif name in ("pad", "slice", "dynamic_slice", "rev") or name in _CUMULATIVE:
        src = invars[0]
        for d in range(len(_shape(out))):
            if name == "rev":
                keep = d not in params["dimensions"]
            elif name in _CUMULATIVE:
                keep = d != params["axis"]
            elif name == "pad":
                keep = tuple(params["padding_config"][d]) == (0, 0, 0)
            else:
                keep = _shape(src)[d] == _shape(out)[d]
            if keep:
                graph.tie(src, d, out, d)
    elif name == "dynamic_update_slice":
        operand, update = invars[0], invars[1]
        graph.tie_all(operand, out)
        for d in range(len(_shape(out))):
            if _is_var(update) and _shape(update)[d] == _shape(out)[d]:
                graph.tie(update, d, out, d)
    elif name == "gather":
        _gather_ties(graph, eqn, invars, outvars, reduced)
    elif name in ("sort", "split", "top_k") or name in _WINDOWED:
        _along_axis_ties(graph, eqn, invars, outvars)
    elif name == "optimization_barrier":
        for src, dst in zip(invars, outvars):
            graph.tie_all(src, dst)
    elif name not in _NOT_ELEMENTWISE and outs and ins:
        # elementwise: operands of the result's shape, scalars, or the same rank with 1s to broadcast
        shape = _shape(outs[0])

        def fits(v):
            s = _shape(v)
            return s == () or (len(s) == len(shape) and all(a in (b, 1) for a, b in zip(s, shape)))

        if all(_shape(v) == shape for v in outs) and all(fits(v) for v in ins):
            for v in ins + outs[1:]:
                for d, size in enumerate(_shape(v)):
                    if size == shape[d]:
                        graph.tie(v, d, outs[0], d)
            same = [v for v in ins if _shape(v) == shape]
            if len(same) == 1 and len(outs) == 1:
                graph.pass_origin(same[0], outs[0], {d: d for d in range(len(shape))})
    graph.eqns.append(_Eqn(name, ins, outs, reduced, weight))


def _scan(graph: _Graph, eqn: Any, invars: list, outvars: list, weight: int) -> None:
    """A scan: consts and carry are tied whole; xs and ys lose their leading (scanned) dim."""
    params = eqn.params
    body = _inner(params["jaxpr"])
    consts, carry = scan_counts(params)
    env: dict = {}
    inner_in = [_val(env, v) for v in body.invars]
    _link_in(graph, invars[: consts + carry], inner_in[: consts + carry])
    for outer, inner in zip(invars[consts + carry:], inner_in[consts + carry:]):
        if _is_var(outer) and _is_var(inner):
            graph.forbid(outer, 0, "a scanned layer dim (nn.scan)")
            for d in range(len(_shape(inner))):
                graph.tie(outer, d + 1, inner, d)
            graph.pass_origin(outer, inner, {d: d + 1 for d in range(len(_shape(inner)))})
            if id(outer) in graph.needs_grad:
                graph.needs_grad.add(id(inner))
    if any(_is_var(v) and id(v) in graph.needs_grad for v in invars):
        graph.needs_grad.update(id(v) for v in inner_in[consts:consts + carry] if _is_var(v))
    _walk(graph, body, env, weight * int(params.get("length", 1)))
    inner_out = [_val(env, v) for v in body.outvars]
    _link_out(graph, inner_out[:carry], outvars[:carry])
    for inner_carry_in, inner_carry_out in zip(inner_in[consts:consts + carry], inner_out[:carry]):
        graph.tie_all(inner_carry_in, inner_carry_out)
    for inner, outer in zip(inner_out[carry:], outvars[carry:]):
        if _is_var(outer) and _is_var(inner):
            graph.forbid(outer, 0, "a scanned layer dim (nn.scan)")
            for d in range(len(_shape(inner))):
                graph.tie(inner, d, outer, d + 1)
            if id(inner) in graph.needs_grad:
                graph.needs_grad.add(id(outer))


def _gather_ties(graph: _Graph, eqn: Any, invars: list, outvars: list, reduced: set) -> None:
    operand, indices = invars[0], invars[1]
    out = outvars[0]
    dnums = eqn.params["dimension_numbers"]
    slice_sizes = eqn.params["slice_sizes"]
    offset_dims = tuple(dnums.offset_dims)
    collapsed = tuple(dnums.collapsed_slice_dims)
    operand_batching = tuple(getattr(dnums, "operand_batching_dims", ()) or ())
    indices_batching = tuple(getattr(dnums, "start_indices_batching_dims", ()) or ())
    out_shape = _shape(out)
    batch_positions = [d for d in range(len(out_shape)) if d not in offset_dims]
    if _is_var(indices):
        for k, d in enumerate(batch_positions):
            if k < len(_shape(indices)) - 1:
                graph.tie(indices, k, out, d)
    if not _is_var(operand):
        return
    for od, idd in zip(operand_batching, indices_batching):
        if _is_var(indices):
            graph.tie(operand, od, indices, idd)
    kept = [d for d in range(len(_shape(operand))) if d not in collapsed and d not in operand_batching]
    for d, position in zip(kept, offset_dims):
        if slice_sizes[d] == _shape(operand)[d]:
            graph.tie(operand, d, out, position)
    for d in dnums.start_index_map:
        graph.note_role(operand, d, "vocab")
        reduced.add((id(operand), d))


def _along_axis_ties(graph: _Graph, eqn: Any, invars: list, outvars: list) -> None:
    name, params = eqn.primitive.name, eqn.params
    src_list = [v for v in invars if _is_var(v)]
    for src in src_list:
        for out in outvars:
            if not _is_var(out) or len(_shape(out)) != len(_shape(src)):
                continue
            for d in range(len(_shape(out))):
                if name == "sort":
                    keep = d != params["dimension"]
                elif name == "split":
                    keep = d != params["axis"]
                elif name == "top_k":
                    keep = d != len(_shape(out)) - 1
                else:
                    keep = (params["window_dimensions"][d] == 1 and params["window_strides"][d] == 1
                            and tuple(params["padding"][d]) == (0, 0))
                if keep and _shape(src)[d] == _shape(out)[d]:
                    graph.tie(src, d, out, d)


# --- choosing the classes ---------------------------------------------------------------------


@dataclasses.dataclass
class _Class:
    root: Any
    nodes: list
    param_nodes: list  # (param index, dim)
    param_bytes: int = 0
    comm_bytes: int = 0
    invalid: str = ""
    order: int = 0
    flows: bool = False  # reaches a value that is not just the param re-laid out
    reduces: bool = False  # contracted, reduced or indexed somewhere

    @property
    def ratio(self) -> float:
        return self.param_bytes / self.comm_bytes if self.comm_bytes else math.inf


def _build(closed_jaxpr: Any, num_params: int, batch_invars: Sequence[int] = ()) -> tuple[_Graph, list, list]:
    """The graph of tied dims of a traced loss whose first ``num_params`` invars are the params."""
    jaxpr = closed_jaxpr.jaxpr
    graph = _Graph()
    env: dict = {}
    invars = [_val(env, v) for v in jaxpr.invars]
    params = invars[:num_params]
    for index, var in enumerate(params):
        graph.add(var)
        graph.needs_grad.add(id(var))
        graph.origin[id(var)] = (index, {d: d for d in range(len(_shape(var)))})
    for index in batch_invars:
        if _is_var(invars[index]) and _shape(invars[index]):
            graph.forbid(invars[index], 0, "the batch dim")
    for var in invars:
        if _is_var(var):
            graph.add(var)
    _walk(graph, jaxpr, env, 1)
    return graph, params, [_val(env, v) for v in jaxpr.outvars]


def _has_scan(jaxpr: Any) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            return True
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, (core.Jaxpr, core.ClosedJaxpr)) and _has_scan(_inner(sub)):
                    return True
    return False


def scanned_dims(closed_jaxpr: Any, param_paths: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """The dims of params that a ``scan`` steps over (``nn.scan``'s stacked layer dim), by path.

    FSDP splits another dim of these params: a scan over a split dim would gather the whole
    stacked param on every device.
    """
    if not _has_scan(closed_jaxpr.jaxpr):
        return {}  # the common case: no graph to build
    graph, params, _ = _build(closed_jaxpr, len(param_paths))
    scanned_roots = {graph.find(node) for node, why in graph.forbidden.items() if "scanned" in why}
    found = {}
    for path, var in zip(param_paths, params):
        dims = tuple(d for d in range(len(_shape(var))) if graph.find((id(var), d)) in scanned_roots)
        if dims:
            found[path] = dims
    return found


def derive_layout(
    closed_jaxpr: Any,
    param_paths: Sequence[str],
    *,
    axis: str,
    axis_size: int,
    batch_invars: Sequence[int] = (),
    fixed: Mapping[str, tuple[int | None, str]] | None = None,
) -> TensorLayout:
    """Derives a Megatron layout for the params from a traced loss.

    Args:
        closed_jaxpr: ``jax.make_jaxpr(loss)(params, ...)``, the params' leaves first.
        param_paths: the path of each of the first ``len(param_paths)`` invars.
        axis: the tensor mesh axis name.
        axis_size: its size.
        batch_invars: indices of invars that are batch leaves (their leading dim is the
            batch, which the tensor axis never splits).
        fixed: params already placed on the tensor axis by a rule or an annotation:
            ``path -> (dim or None, "rule" | "annotation")``; the derivation keeps them
            and builds around them.

    Returns:
        A :class:`TensorLayout` with one entry per param path.
    """
    fixed = dict(fixed or {})
    graph, params, outvars = _build(closed_jaxpr, len(param_paths), batch_invars)
    classes = _classes(graph, params, axis_size)
    _add_costs(graph, classes, outvars)
    conflicts = _conflicts(graph)

    chosen: list = []
    chosen_roots: set = set()
    reasons: dict = {}
    # fixed placements come first: their classes are taken whatever they cost
    for index, path in enumerate(param_paths):
        if path in fixed and fixed[path][0] is not None:
            root = graph.find((id(params[index]), fixed[path][0]))
            if root in classes and root not in chosen_roots:
                chosen.append(classes[root])
                chosen_roots.add(root)
    candidates = sorted(
        (c for c in classes.values() if c.root not in chosen_roots and any(
            len(_shape(params[i])) >= 2 for i, _ in c.param_nodes)),
        key=lambda c: (-c.ratio, -c.param_bytes, c.order),
    )
    for cls in candidates:
        if cls.invalid:
            reasons[cls.root] = cls.invalid
            continue
        if not (cls.flows or cls.reduces):
            reasons[cls.root] = "the computation uses it whole (splitting it would only gather it back)"
            continue
        clash = next((other for other in chosen if other.root in conflicts.get(cls.root, ())), None)
        if clash is not None:
            reasons[cls.root] = f"shares arrays with {_describe_class(clash, param_paths, params, graph.roles)}, split instead"
            continue
        chosen.append(cls)
        chosen_roots.add(cls.root)

    entries = []
    for index, (path, var) in enumerate(zip(param_paths, params)):
        shape = _shape(var)
        if path in fixed:
            dim, source = fixed[path]
            entries.append(ParamLayout(path, shape, dim, source if dim is not None else "",
                                       f"placed by a {source}" if dim is not None else f"kept whole by a {source}"))
            continue
        split = [d for d in range(len(shape)) if (id(var), d) in graph.parent and graph.find((id(var), d)) in chosen_roots]
        if split:
            dim = split[0]
            cls = classes[graph.find((id(var), dim))]
            role = _role(graph.roles, index, dim) or "elementwise"
            entries.append(ParamLayout(path, shape, dim, role, _split_reason(cls, param_paths, params, graph.roles)))
        else:
            entries.append(ParamLayout(path, shape, None, "", _unsplit_reason(graph, var, classes, reasons)))
    return TensorLayout(axis, axis_size, tuple(entries))


def _classes(graph: _Graph, params: list, axis_size: int) -> dict:
    classes: dict = {}
    for order, node in enumerate(graph.parent):
        root = graph.find(node)
        cls = classes.get(root)
        if cls is None:
            cls = classes[root] = _Class(root, [], [], order=order)
        cls.nodes.append(node)
    index_of = {id(v): i for i, v in enumerate(params)}
    for cls in classes.values():
        seen_vars: dict = {}
        for node in cls.nodes:
            var_id, dim = node
            if node in graph.forbidden and not cls.invalid:
                cls.invalid = f"its dim is {graph.forbidden[node]}"
            if graph.size[node] % axis_size and not cls.invalid:
                cls.invalid = (f"its chain has a dim of size {graph.size[node]}, which the axis size "
                               f"{axis_size} does not divide")
            if var_id in seen_vars and not cls.invalid:
                cls.invalid = "the chain ties two dims of one array together"
            seen_vars[var_id] = dim
            if var_id not in graph.origin:
                cls.flows = True
            if var_id in index_of:
                cls.param_nodes.append((index_of[var_id], dim))
                cls.param_bytes += _nbytes(graph.vars[var_id])
    return {root: cls for root, cls in classes.items() if cls.param_nodes}


def _add_costs(graph: _Graph, classes: dict, outvars: Sequence) -> None:
    """Bytes communicated per step if a class is split (forward and backward)."""

    def classes_of(var):
        return {graph.find((id(var), d)) for d in range(len(_shape(var))) if (id(var), d) in graph.parent}

    for eqn in graph.eqns:
        in_classes = [classes_of(v) for v in eqn.invars]
        out_classes = set().union(*(classes_of(v) for v in eqn.outvars)) if eqn.outvars else set()
        ends = set().union(*in_classes) - out_classes if in_classes else set()
        for root in ends & classes.keys():
            if any(graph.find(node) == root for node in eqn.reduced):
                classes[root].reduces = True
                cost = sum(_nbytes(v) for v in eqn.outvars)  # partial sums: all-reduce the result
            else:
                cost = sum(_nbytes(v) for v, found in zip(eqn.invars, in_classes) if root in found)  # all-gather
            classes[root].comm_bytes += cost * eqn.weight
        for root in out_classes & classes.keys():
            # an operand that lacks the split dim gets a partial gradient: all-reduce it
            lacking = [v for v, found in zip(eqn.invars, in_classes) if root not in found and id(v) in graph.needs_grad]
            classes[root].comm_bytes += sum(_nbytes(v) for v in lacking) * eqn.weight
    for var in outvars:
        if _is_var(var):
            for root in classes_of(var) & classes.keys():
                classes[root].comm_bytes += _nbytes(var)


def _conflicts(graph: _Graph) -> dict:
    """root -> roots of classes that share an array with it (one array can split one dim)."""
    found: dict = {}
    for var_id, var in graph.vars.items():
        roots = {graph.find((var_id, d)) for d in range(len(_shape(var))) if graph.size.get((var_id, d), 1) > 1}
        if len(roots) > 1:
            for root in roots:
                found.setdefault(root, set()).update(roots - {root})
    return found


def _describe_class(cls: _Class, param_paths: Sequence[str], params: list, roles: Mapping) -> str:
    names = [f"{param_paths[i]}[{d}]" + (f" {_role(roles, i, d)}" if _role(roles, i, d) else "")
             for i, d in cls.param_nodes if len(_shape(params[i])) >= 2]
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    return f"the chain {shown}"


def _fmt_bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _role(roles: Mapping, index: int, dim: int) -> str:
    found = roles.get((index, dim), set())
    return next((r for r in ("vocab", "row", "column") if r in found), "")


def _split_reason(cls: _Class, param_paths, params, roles: Mapping) -> str:
    size = _shape(params[cls.param_nodes[0][0]])[cls.param_nodes[0][1]]
    comm = _fmt_bytes(cls.comm_bytes) if cls.comm_bytes else "nothing"
    return f"splits {_describe_class(cls, param_paths, params, roles)} (size {size}); communicates {comm} per step"


def _unsplit_reason(graph: _Graph, var: Any, classes: dict, reasons: dict) -> str:
    shape = _shape(var)
    if not shape:
        return "a scalar"
    notes = []
    for d in sorted(range(len(shape)), key=lambda d: -shape[d]):
        node = (id(var), d)
        if shape[d] <= 1 or node not in graph.parent:
            continue
        root = graph.find(node)
        if root in reasons:
            notes.append(f"dim {d} ({shape[d]}): {reasons[root]}")
        elif root in classes and classes[root].invalid:
            notes.append(f"dim {d} ({shape[d]}): {classes[root].invalid}")
    if not notes:
        return "a bias or scale whose dims no split chain reaches" if len(shape) == 1 else "no matmul chain found"
    return "; ".join(notes[:2])
