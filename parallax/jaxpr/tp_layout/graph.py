"""The dim graph: a node per dim of every traced value, tied by union-find."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from jax.extend import core

REDUCTIONS = {
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor",
    "argmax", "argmin",
}
CUMULATIVE = {"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"}
WINDOWED = {"reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window",
             "select_and_gather_add", "select_and_scatter_add"}
NOT_ELEMENTWISE = {
    "fft", "triangular_solve", "cholesky", "lu", "qr", "eigh", "eig", "svd", "schur", "custom_linear_solve",
    "linear_solve", "tridiagonal", "tridiagonal_solve", "householder_product", "rng_bit_generator",
    "scatter", "scatter-add", "scatter_add", "scatter_mul", "scatter_min", "scatter_max",
}
CALL_JAXPR_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


class _Val:
    """One value of one call: a sub-computation called twice (a shared ``jit``) has two."""

    __slots__ = ("__weakref__", "dtype", "shape")

    def __init__(self, shape: tuple[int, ...], dtype: Any):
        self.shape = shape
        self.dtype = dtype


def shape_of(val: Any) -> tuple[int, ...] | None:
    return val.shape if isinstance(val, _Val) else None


def nbytes(val: Any) -> int:
    if not isinstance(val, _Val):
        return 0
    return math.prod(val.shape) * getattr(val.dtype, "itemsize", 4)  # a typed PRNG key's dtype has one too


def is_var(x: Any) -> bool:
    return isinstance(x, _Val)


def value_of(env: dict, var: Any) -> _Val | None:
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
class Eqn:
    """An op as the cost model sees it: the values in and out and the dims it reduces."""

    name: str
    invars: list
    outvars: list
    reduced: set  # nodes (var, dim) of invars contracted or reduced (their class ends in an all-reduce)
    weight: int  # how many times it runs (scan length)


class DimGraph:
    def __init__(self):
        self.parent: dict = {}
        self.size: dict = {}
        self.forbidden: dict = {}  # node -> why its class must not be split
        self.eqns: list[Eqn] = []
        self.needs_grad: set = set()  # vars (by id) that depend on a param
        self.vars: dict = {}  # id -> var, every var with nodes
        self.origin: dict = {}  # id(var) -> (param index, {var dim: param dim})
        self.roles: dict = {}  # (param index, param dim) -> set of roles

    # union-find over nodes (id(var), dim)
    def add(self, var: Any) -> None:
        if id(var) in self.vars:
            return
        self.vars[id(var)] = var
        for dim, size in enumerate(shape_of(var)):
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
        if not (is_var(a) and is_var(b)):
            return
        self.add(a)
        self.add(b)
        if shape_of(a)[dim_a] <= 1 or shape_of(b)[dim_b] <= 1:
            return
        ra, rb = self.find((id(a), dim_a)), self.find((id(b), dim_b))
        if ra != rb:
            self.parent[ra] = rb

    def tie_all(self, a: Any, b: Any) -> None:
        if is_var(a) and is_var(b) and len(shape_of(a)) == len(shape_of(b)):
            for d in range(len(shape_of(a))):
                self.tie(a, d, b, d)

    def forbid(self, var: Any, dim: int, why: str) -> None:
        if is_var(var):
            self.add(var)
            self.forbidden.setdefault((id(var), dim), why)

    def note_role(self, var: Any, dim: int, role: str) -> None:
        found = self.origin.get(id(var)) if is_var(var) else None
        if found is not None and dim in found[1]:
            self.roles.setdefault((found[0], found[1][dim]), set()).add(role)

    def pass_origin(self, src: Any, dst: Any, dim_map: Mapping[int, int]) -> None:
        """``dst`` is ``src`` re-laid out: ``dst`` dim ``d`` is ``src`` dim ``dim_map[d]``."""
        found = self.origin.get(id(src)) if is_var(src) else None
        if found is not None and is_var(dst):
            self.origin[id(dst)] = (found[0], {d: found[1][s] for d, s in dim_map.items() if s in found[1]})


@dataclasses.dataclass
class ParamClass:
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
