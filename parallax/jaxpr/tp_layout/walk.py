"""Walking a jaxpr (sub-computations and scans included) to build the dim graph."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
from jax.extend import core

from parallax._compat import scan_counts
from parallax.jaxpr.tp_layout.graph import (
    CALL_JAXPR_PARAMS,
    CUMULATIVE,
    NOT_ELEMENTWISE,
    REDUCTIONS,
    WINDOWED,
    DimGraph,
    Eqn,
    is_var,
    shape_of,
    value_of,
)
from parallax.jaxpr.tp_layout.ties import (
    along_axis_ties,
    gather_ties,
    reshape_ties,
)


def _sub_jaxpr(eqn: Any):
    for key in CALL_JAXPR_PARAMS:
        sub = eqn.params.get(key)
        if sub is None:
            continue
        jaxpr = sub.jaxpr if isinstance(sub, core.ClosedJaxpr) else sub
        if (isinstance(jaxpr, core.Jaxpr) and len(jaxpr.invars) == len(eqn.invars)
                and len(jaxpr.outvars) == len(eqn.outvars)):
            return jaxpr
    return None


def _inner(closed: Any):
    return closed.jaxpr if isinstance(closed, core.ClosedJaxpr) else closed


def _walk(graph: DimGraph, jaxpr: Any, env: dict, weight: int) -> None:
    for eqn in jaxpr.eqns:
        _visit(graph, eqn, env, weight)


def _link_in(graph: DimGraph, outer_in: Sequence, inner_in: Sequence) -> None:
    for outer, inner in zip(outer_in, inner_in):
        graph.tie_all(outer, inner)
        if is_var(outer) and is_var(inner):
            graph.pass_origin(outer, inner, {d: d for d in range(len(shape_of(inner)))})
            if id(outer) in graph.needs_grad:
                graph.needs_grad.add(id(inner))


def _link_out(graph: DimGraph, inner_out: Sequence, outer_out: Sequence) -> None:
    for inner, outer in zip(inner_out, outer_out):
        graph.tie_all(inner, outer)
        if is_var(inner) and is_var(outer) and id(inner) in graph.needs_grad:
            graph.needs_grad.add(id(outer))


def _call(graph: DimGraph, jaxpr: Any, outer_in: Sequence, outer_out: Sequence, weight: int) -> tuple[list, list]:
    """Walks a sub-computation with fresh values, tied to the caller's; returns its invars and outvars."""
    env: dict = {}
    inner_in = [value_of(env, v) for v in jaxpr.invars]
    _link_in(graph, outer_in, inner_in)
    _walk(graph, jaxpr, env, weight)
    inner_out = [value_of(env, v) for v in jaxpr.outvars]
    _link_out(graph, inner_out, outer_out)
    return inner_in, inner_out


def _visit(graph: DimGraph, eqn: Any, env: dict, weight: int) -> None:
    name = eqn.primitive.name
    invars = [value_of(env, v) for v in eqn.invars]
    outvars = [value_of(env, v) for v in eqn.outvars]
    ins = [v for v in invars if is_var(v)]
    outs = [v for v in outvars if is_var(v)]
    for v in ins + outs:
        graph.add(v)
    if any(id(v) in graph.needs_grad for v in ins):
        for v in outs:
            if jnp.issubdtype(v.dtype, jnp.floating):  # jnp: a key<fry> value is not a NumPy dtype
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
        lhs_free = [d for d in range(len(shape_of(lhs))) if d not in lc and d not in lb]
        rhs_free = [d for d in range(len(shape_of(rhs))) if d not in rc and d not in rb]
        for k, (dl, dr) in enumerate(zip(lb, rb)):
            graph.tie(lhs, dl, out, k)
            graph.tie(rhs, dr, out, k)
            for var, dim, other in ((lhs, dl, rhs), (rhs, dr, lhs)):
                if is_var(other) and id(other) not in graph.origin:  # a param batched with activations: experts
                    graph.note_role(var, dim, "expert")
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
            reduced.update({(id(lhs), dl), (id(rhs), dr)} if is_var(lhs) and is_var(rhs) else set())
    elif name == "conv_general_dilated":
        lhs, rhs = invars
        lhs_spec, rhs_spec, out_spec = params["dimension_numbers"]
        graph.tie(lhs, lhs_spec[0], out, out_spec[0])
        graph.tie(rhs, rhs_spec[0], out, out_spec[1])
        graph.note_role(rhs, rhs_spec[0], "column")
        if params.get("feature_group_count", 1) == 1 and params.get("batch_group_count", 1) == 1:
            graph.tie(lhs, lhs_spec[1], rhs, rhs_spec[1])
            graph.note_role(rhs, rhs_spec[1], "row")
            if is_var(lhs) and is_var(rhs):
                reduced.update({(id(lhs), lhs_spec[1]), (id(rhs), rhs_spec[1])})
        elif params.get("batch_group_count", 1) == 1:
            graph.tie(lhs, lhs_spec[1], out, out_spec[1])  # grouped/depthwise: groups follow the channels
    elif name in REDUCTIONS:
        axes = tuple(params["axes"])
        kept = [d for d in range(len(shape_of(invars[0]))) if d not in axes]
        for k, d in enumerate(kept):
            graph.tie(invars[0], d, out, k)
        if is_var(invars[0]):
            reduced.update((id(invars[0]), d) for d in axes)
    elif name == "broadcast_in_dim":
        src = invars[0]
        if is_var(src):
            for k, d in enumerate(params["broadcast_dimensions"]):
                if shape_of(src)[k] == shape_of(out)[d]:
                    graph.tie(src, k, out, d)
            graph.pass_origin(src, out, {d: k for k, d in enumerate(params["broadcast_dimensions"])})
    elif name == "reshape":
        if is_var(invars[0]):
            reshape_ties(graph, invars[0], out)
    elif name == "transpose":
        perm = params["permutation"]
        for k, d in enumerate(perm):
            graph.tie(invars[0], d, out, k)
        graph.pass_origin(invars[0], out, dict(enumerate(perm)))
    elif name == "squeeze":
        src = invars[0]
        kept = [d for d in range(len(shape_of(src))) if d not in params["dimensions"]]
        for k, d in enumerate(kept):
            graph.tie(src, d, out, k)
        graph.pass_origin(src, out, dict(enumerate(kept)))
    elif name == "concatenate":
        axis = params["dimension"]
        for src in invars:
            for d in range(len(shape_of(out))):
                if d != axis:
                    graph.tie(src, d, out, d)
    elif name in ("pad", "slice", "dynamic_slice", "rev") or name in CUMULATIVE:
        src = invars[0]
        for d in range(len(shape_of(out))):
            if name == "rev":
                keep = d not in params["dimensions"]
            elif name in CUMULATIVE:
                keep = d != params["axis"]
            elif name == "pad":
                keep = tuple(params["padding_config"][d]) == (0, 0, 0)
            else:
                keep = shape_of(src)[d] == shape_of(out)[d]
            if keep:
                graph.tie(src, d, out, d)
    elif name == "dynamic_update_slice":
        operand, update = invars[0], invars[1]
        graph.tie_all(operand, out)
        for d in range(len(shape_of(out))):
            if is_var(update) and shape_of(update)[d] == shape_of(out)[d]:
                graph.tie(update, d, out, d)
    elif name == "gather":
        gather_ties(graph, eqn, invars, outvars, reduced)
    elif name in ("sort", "split", "top_k") or name in WINDOWED:
        along_axis_ties(graph, eqn, invars, outvars)
    elif name == "optimization_barrier":
        for src, dst in zip(invars, outvars):
            graph.tie_all(src, dst)
    elif name not in NOT_ELEMENTWISE and outs and ins:
        # elementwise: operands of the result's shape, scalars, or the same rank with 1s to broadcast
        shape = shape_of(outs[0])

        def fits(v):
            s = shape_of(v)
            return s == () or (len(s) == len(shape) and all(a in (b, 1) for a, b in zip(s, shape)))

        if all(shape_of(v) == shape for v in outs) and all(fits(v) for v in ins):
            for v in ins + outs[1:]:
                for d, size in enumerate(shape_of(v)):
                    if size == shape[d]:
                        graph.tie(v, d, outs[0], d)
            same = [v for v in ins if shape_of(v) == shape]
            if len(same) == 1 and len(outs) == 1:
                graph.pass_origin(same[0], outs[0], {d: d for d in range(len(shape))})
    graph.eqns.append(Eqn(name, ins, outs, reduced, weight))


def _scan(graph: DimGraph, eqn: Any, invars: list, outvars: list, weight: int) -> None:
    """A scan: consts and carry are tied whole; xs and ys lose their leading (scanned) dim."""
    params = eqn.params
    body = _inner(params["jaxpr"])
    consts, carry = scan_counts(params)
    env: dict = {}
    inner_in = [value_of(env, v) for v in body.invars]
    _link_in(graph, invars[: consts + carry], inner_in[: consts + carry])
    for outer, inner in zip(invars[consts + carry:], inner_in[consts + carry:]):
        if is_var(outer) and is_var(inner):
            graph.forbid(outer, 0, "a scanned layer dim (nn.scan)")
            for d in range(len(shape_of(inner))):
                graph.tie(outer, d + 1, inner, d)
            graph.pass_origin(outer, inner, {d: d + 1 for d in range(len(shape_of(inner)))})
            if id(outer) in graph.needs_grad:
                graph.needs_grad.add(id(inner))
    if any(is_var(v) and id(v) in graph.needs_grad for v in invars):
        graph.needs_grad.update(id(v) for v in inner_in[consts:consts + carry] if is_var(v))
    _walk(graph, body, env, weight * int(params.get("length", 1)))
    inner_out = [value_of(env, v) for v in body.outvars]
    _link_out(graph, inner_out[:carry], outvars[:carry])
    for inner_carry_in, inner_carry_out in zip(inner_in[consts:consts + carry], inner_out[:carry]):
        graph.tie_all(inner_carry_in, inner_carry_out)
    for inner, outer in zip(inner_out[carry:], outvars[carry:]):
        if is_var(outer) and is_var(inner):
            graph.forbid(outer, 0, "a scanned layer dim (nn.scan)")
            for d in range(len(shape_of(inner))):
                graph.tie(inner, d, outer, d + 1)
            if id(inner) in graph.needs_grad:
                graph.needs_grad.add(id(outer))


def build_graph(closed_jaxpr: Any, num_params: int, batch_invars: Sequence[int] = ()) -> tuple[DimGraph, list, list]:
    """The graph of tied dims of a traced loss whose first ``num_params`` invars are the params."""
    jaxpr = closed_jaxpr.jaxpr
    graph = DimGraph()
    env: dict = {}
    invars = [value_of(env, v) for v in jaxpr.invars]
    params = invars[:num_params]
    for index, var in enumerate(params):
        graph.add(var)
        graph.needs_grad.add(id(var))
        graph.origin[id(var)] = (index, {d: d for d in range(len(shape_of(var)))})
    for index in batch_invars:
        if is_var(invars[index]) and shape_of(invars[index]):
            graph.forbid(invars[index], 0, "the batch dim")
    for var in invars:
        if is_var(var):
            graph.add(var)
    _walk(graph, jaxpr, env, 1)
    return graph, params, [value_of(env, v) for v in jaxpr.outvars]


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
    graph, params, _ = build_graph(closed_jaxpr, len(param_paths))
    scanned_roots = {graph.find(node) for node, why in graph.forbidden.items() if "scanned" in why}
    found = {}
    for path, var in zip(param_paths, params):
        dims = tuple(d for d in range(len(shape_of(var))) if graph.find((id(var), d)) in scanned_roots)
        if dims:
            found[path] = dims
    return found


def expert_dims(closed_jaxpr: Any, param_paths: Sequence[str]) -> dict[str, int]:
    """The experts dim of each param that stacks a mixture of experts' weights, by path.

    A param dim that a matmul batches over together with activations (the per-expert weights of
    ``einsum("ecd,edh->ech", dispatched, w_in)``), and the same dim of every other stacked param
    the computation ties to it, of those weights' rank (``w_in[e]`` whose outputs meet
    ``w_out[e]``'s); a router's kernel, whose output dim is the experts' logits, stays whole (a
    matrix, one rank less; in a stack of layers each has one dim more).
    """
    graph, params, _ = build_graph(closed_jaxpr, len(param_paths))
    experts = [(index, dim) for (index, dim), roles in graph.roles.items() if "expert" in roles]
    roots = {graph.find((id(params[index]), dim)) for index, dim in experts}
    rank = min((len(shape_of(params[index])) for index, _ in experts), default=3)
    found = {}
    for index, (path, var) in enumerate(zip(param_paths, params)):
        for dim in range(len(shape_of(var))):
            if (index, dim) in experts or (len(shape_of(var)) >= rank and graph.find((id(var), dim)) in roots):
                found[path] = dim
                break
    return found
