"""The rule of each primitive on per-example values: where the example dim goes, or why it mixes."""

from __future__ import annotations

from typing import Any

import numpy as np

from parallax.jaxpr.chains import sub_jaxprs
from parallax.jaxpr.per_example.domain import BatchSum, Fixed, NotPerExample, PerExample

IDENTITY = {"convert_element_type", "copy", "copy_p", "reduce_precision", "sharding_constraint",
            "optimization_barrier", "stop_gradient", "pvary", "mesh_cast", "reshard"}
ELEMENTWISE = IDENTITY | {
    "add", "sub", "mul", "div", "rem", "pow", "max", "min", "neg", "sign", "floor", "ceil", "round", "abs",
    "exp", "exp2", "expm1", "log", "log1p", "tanh", "logistic", "sin", "cos", "tan", "asin", "acos", "atan",
    "sinh", "cosh", "asinh", "acosh", "atanh", "atan2", "sqrt", "rsqrt", "cbrt", "square", "integer_pow",
    "erf", "erfc", "erf_inv", "lgamma", "digamma", "is_finite", "nextafter", "select_n", "clamp", "eq", "ne",
    "lt", "le", "gt", "ge", "and", "or", "not", "xor", "shift_left", "shift_right_logical",
    "shift_right_arithmetic", "population_count", "real", "imag", "conj", "add_any",
}
_REDUCE_OTHER = {"reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor", "argmax",
                 "argmin"}
_ALONG_AXIS = {"cumsum": "axis", "cumprod": "axis", "cummax": "axis", "cummin": "axis", "cumlogsumexp": "axis",
               "sort": "dimension", "split": "axis"}
_WINDOWED = {"reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window"}


def shape(var: Any) -> tuple:
    """A jaxpr value's shape."""
    return tuple(var.aval.shape)


_shape = shape


def _the(ins: list) -> PerExample:
    """The one example layout of the per-example inputs (all must agree)."""
    found = {a for a in ins if isinstance(a, PerExample)}
    if len(found) > 1:
        raise NotPerExample("it combines values whose example dims do not line up (examples meet each other)")
    return found.pop()


def _aligned(eqn: Any, ins: list, per: PerExample) -> None:
    """Batch-free operands of the same rank must be constant along the example dim."""
    out = _shape(eqn.outvars[0])
    for var, a in zip(eqn.invars, ins):
        if len(_shape(var)) != len(out) or not out:
            continue  # a scalar operand
        size = _shape(var)[per.dim]
        if isinstance(a, PerExample) and size != out[per.dim]:
            raise NotPerExample(f"{eqn.primitive.name} broadcasts one example's values over others")
        if isinstance(a, Fixed) and size != 1 and per.dim not in a.uniform:
            raise NotPerExample(f"{eqn.primitive.name} pairs each example with a different slice of a value "
                                "that does not come from the batch (e.g. an index over the batch)")


def _aligned_inputs(eqn: Any, ins: list, per: PerExample) -> None:
    """Operands of one shape (``stack``): the same example dim, batch-free ones constant along it."""
    for var, a in zip(eqn.invars, ins):
        if isinstance(a, PerExample) and a != per:
            raise NotPerExample(f"{eqn.primitive.name} combines values whose example dims do not line up")
        if isinstance(a, Fixed) and _shape(var)[per.dim] != 1 and per.dim not in a.uniform:
            raise NotPerExample(f"{eqn.primitive.name} pairs each example with a different slice of a value "
                                "that does not come from the batch")


def unstacked(value: Any) -> Any:
    """A ``scan``'s per-iteration slice of ``value`` (its leading dim removed)."""
    if isinstance(value, PerExample):
        if value.dim == 0:
            raise NotPerExample("it scans over the examples")
        return PerExample(value.dim - 1, value.block)
    if isinstance(value, Fixed):
        return Fixed(frozenset(d - 1 for d in value.uniform if d), value.value)
    return value


def stacked(value: Any) -> Any:
    """A ``scan``'s stacked outputs from the per-iteration ``value``."""
    if isinstance(value, PerExample):
        return PerExample(value.dim + 1, value.block)
    if isinstance(value, Fixed):
        return Fixed(frozenset(d + 1 for d in value.uniform), None)
    return value


def per_example(eqn: Any, ins: list):
    """The output of a primitive with per-example inputs (the others batch-free); one value for
    every output, or a list."""
    name, params = eqn.primitive.name, eqn.params
    if name == "dot_general":
        return _dot(eqn, ins)
    if name == "pallas_call":
        return _kernel(eqn, ins)
    per = _the(ins)
    if name in ELEMENTWISE or (name == "concatenate" and params["dimension"] != per.dim):
        _aligned(eqn, ins, per)
        return per
    if name in ("reduce_sum", *_REDUCE_OTHER) or name in _ALONG_AXIS or name in _WINDOWED:
        return _along(eqn, ins, per)
    if name == "broadcast_in_dim":
        dims = params["broadcast_dimensions"]
        if _shape(eqn.invars[0])[per.dim] != params["shape"][dims[per.dim]]:
            raise NotPerExample("it broadcasts along the example dim")
        return PerExample(dims[per.dim], per.block)
    if name == "stack":
        _aligned_inputs(eqn, ins, per)
        return PerExample(per.dim + (per.dim >= params["axis"]), per.block)
    if name == "transpose":
        return PerExample(list(params["permutation"]).index(per.dim), per.block)
    if name == "squeeze":
        dims = [d % len(_shape(eqn.invars[0])) for d in params["dimensions"]]
        if per.dim in dims:
            raise NotPerExample("it squeezes the example dim")
        return PerExample(per.dim - sum(d < per.dim for d in dims), per.block)
    if name == "reshape":
        return _reshape(eqn, per)
    if name in ("slice", "dynamic_slice", "pad"):
        return _whole_along(eqn, ins, per)
    if name == "dynamic_update_slice":
        if not all(isinstance(a, Fixed) for a in ins[2:]):
            raise NotPerExample("it indexes with a value computed from the batch")
        if _shape(eqn.invars[1])[per.dim] != _shape(eqn.invars[0])[per.dim]:
            raise NotPerExample("it updates part of the example dim")
        _aligned(eqn, ins[:2], per)
        return per
    if name == "conv_general_dilated":
        return _conv(eqn, ins, per)
    if name == "gather":
        return _gather(eqn, ins)
    if name == "top_k" and per.dim != len(_shape(eqn.invars[0])) - 1:
        return per
    if name == "bitcast_convert_type":  # the same elements reinterpreted; a width change adds or drops the last dim
        source, target = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
        if source == target or per.dim < min(len(source), len(target)) - 1:
            return per
        raise NotPerExample("it reinterprets the bits of the example dim (bitcast_convert_type)")
    raise NotPerExample(f"it applies {name}, which the proof does not know, to per-example values")


def _along(eqn: Any, ins: list, per: PerExample) -> Any:
    """Reductions, cumulative ops, sorts and windows: fine unless they run along the example dim."""
    name, params = eqn.primitive.name, eqn.params
    if not isinstance(ins[0], PerExample):
        raise NotPerExample(f"{name} reads per-example values in a way the proof does not know")
    if name in _WINDOWED:
        d = per.dim
        dilations = (params.get("base_dilation") or (1,) * (d + 1), params.get("window_dilation") or (1,) * (d + 1))
        if (params["window_dimensions"][d] != 1 or params["window_strides"][d] != 1
                or tuple(params["padding"][d]) != (0, 0) or dilations[0][d] != 1 or dilations[1][d] != 1):
            raise NotPerExample(f"{name} has a window across examples")
        return per
    if name in _ALONG_AXIS:
        if params[_ALONG_AXIS[name]] == per.dim:
            raise NotPerExample(f"it takes {name} along the examples")
        _aligned(eqn, ins, per)  # a sort's other operands travel with each example's keys
        return per
    axes = params["axes"]
    if per.dim in axes:
        if name == "reduce_sum":
            return BatchSum()
        raise NotPerExample(f"it takes {name} over the examples")
    return PerExample(per.dim - sum(a < per.dim for a in axes), per.block)


def _reshape(eqn: Any, per: PerExample) -> PerExample:
    """The example dim survives a reshape when the dims around it only merge or split.

    A unit dim holds the examples only where there is one (a trace of one row, a pipeline's
    microbatch of one): ``(8, 32)`` holding one example's 8 tokens, reshaped to ``(1, 8, 4, 8)``,
    holds it on dim 0, as ``(16, 32)`` holding two reshaped to ``(2, 8, 4, 8)`` holds them."""
    if eqn.params.get("dimensions") is not None:
        raise NotPerExample("it reshapes with a transposition")
    source, target = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
    outer, inner = int(np.prod(source[:per.dim])), int(np.prod(source[per.dim + 1:]))
    single = source[per.dim] == per.block  # the dim holds one example
    for e in range(len(target)):
        if int(np.prod(target[:e])) != outer:
            continue
        inner_e = int(np.prod(target[e + 1:]))
        if (target[e] > 1 or single) and (per.block * inner) % inner_e == 0:
            block = per.block * inner // inner_e
            if target[e] % block == 0:
                return PerExample(e, block)
    raise NotPerExample(f"it reshapes {source} to {target} across the example dim")


def _whole_along(eqn: Any, ins: list, per: PerExample) -> PerExample:
    """``slice``/``dynamic_slice``/``pad`` that keep the example dim whole."""
    name, params, d = eqn.primitive.name, eqn.params, per.dim
    if not isinstance(ins[0], PerExample) or not all(isinstance(a, Fixed) for a in ins[1:]):
        raise NotPerExample(f"{name} indexes with a value computed from the batch")
    size = _shape(eqn.invars[0])[d]
    if name == "slice":
        strides = params["strides"] or (1,) * len(_shape(eqn.invars[0]))
        whole = params["start_indices"][d] == 0 and params["limit_indices"][d] == size and strides[d] == 1
    elif name == "dynamic_slice":
        whole = params["slice_sizes"][d] == size
    else:
        whole = tuple(params["padding_config"][d]) == (0, 0, 0)
    if not whole:
        raise NotPerExample(f"it takes part of the example dim ({name})")
    return per


def _dot(eqn: Any, ins: list) -> Any:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = ins
    ls, rs = _shape(eqn.invars[0]), _shape(eqn.invars[1])
    lhs_free = [d for d in range(len(ls)) if d not in lc and d not in lb]
    rhs_free = [d for d in range(len(rs)) if d not in rc and d not in rb]

    def partner(per: PerExample, other: Any, mine: tuple, theirs: tuple) -> None:
        d = theirs[list(mine).index(per.dim)]
        if isinstance(other, PerExample) and (other.dim, other.block) == (d, per.block):
            return
        if isinstance(other, Fixed) and d in other.uniform:
            return
        raise NotPerExample("a matmul pairs each example with values from other examples")

    for per, other, contract, other_contract, batch, other_batch in (
            (lhs, rhs, lc, rc, lb, rb), (rhs, lhs, rc, lc, rb, lb)):
        if not isinstance(per, PerExample):
            continue
        if per.dim in contract:
            partner(per, other, contract, other_contract)
            return BatchSum()  # a sum over the examples of per-example products
        if per.dim in batch:
            partner(per, other, batch, other_batch)
            return PerExample(list(batch).index(per.dim), per.block)
    if isinstance(lhs, PerExample) and isinstance(rhs, PerExample):
        raise NotPerExample("a matmul pairs every example with every other (e.g. in-batch similarities)")
    if isinstance(lhs, PerExample):
        return PerExample(len(lb) + lhs_free.index(lhs.dim), lhs.block)
    return PerExample(len(lb) + len(lhs_free) + rhs_free.index(rhs.dim), rhs.block)


def _conv(eqn: Any, ins: list, per: PerExample) -> PerExample:
    numbers = eqn.params["dimension_numbers"]
    if not isinstance(ins[0], PerExample) or isinstance(ins[1], PerExample) or eqn.params["batch_group_count"] != 1:
        raise NotPerExample("a convolution mixes examples")
    if per.dim != numbers.lhs_spec[0] or per.block != 1:
        raise NotPerExample("a convolution runs across the example dim")
    return PerExample(numbers.out_spec[0])


def _gather(eqn: Any, ins: list) -> PerExample:
    """Embedding lookups (batch-free table, per-example indices) and ``take_along_axis``."""
    numbers, slice_sizes = eqn.params["dimension_numbers"], eqn.params["slice_sizes"]
    operand, indices = ins
    index_shape, out_rank = _shape(eqn.invars[1]), len(_shape(eqn.outvars[0]))
    index_vector_dim = len(index_shape) - 1
    index_dims = [d for d in range(len(index_shape)) if d != index_vector_dim]
    batch_positions = [d for d in range(out_rank) if d not in numbers.offset_dims]
    operand_batching = tuple(getattr(numbers, "operand_batching_dims", ()))
    indices_batching = tuple(getattr(numbers, "start_indices_batching_dims", ()))
    if isinstance(operand, PerExample):
        if operand.dim not in operand_batching:
            if operand.dim in numbers.start_index_map or slice_sizes[operand.dim] != _shape(eqn.invars[0])[operand.dim]:
                raise NotPerExample("it indexes into the example dim")
            if not all(isinstance(a, Fixed) for a in ins[1:]):
                raise NotPerExample("a gather reads per-example values at per-example indices")
            kept = [d for d in range(len(_shape(eqn.invars[0])))
                    if d not in numbers.collapsed_slice_dims and d not in operand_batching]
            return PerExample(numbers.offset_dims[kept.index(operand.dim)], operand.block)
        paired = indices_batching[operand_batching.index(operand.dim)]
        if isinstance(indices, PerExample):
            if (indices.dim, indices.block) != (paired, operand.block):
                raise NotPerExample("a gather pairs examples with other examples' indices")
        elif paired not in indices.uniform:
            raise NotPerExample("a gather reads each example at an index that depends on its position")
        return PerExample(batch_positions[index_dims.index(paired)], operand.block)
    if indices.dim == index_vector_dim:
        raise NotPerExample("a gather's index vector runs over the examples")
    return PerExample(batch_positions[index_dims.index(indices.dim)], indices.block)


def _kernel(eqn: Any, ins: list) -> list:
    """A Pallas kernel computes each example on its own where each cell of its grid sees one example:
    every per-example operand and output is blocked one example at a time along its example dim, by
    the same grid axis; no batch-free operand's block moves along that axis; the kernel never reads
    that axis's index or size (which would tell it where in the batch the example sits); and it keeps
    no scratch memory from one cell to the next."""
    mapping = eqn.params["grid_mapping"]
    per = _the(ins)
    firsts = mapping.num_index_operands
    if per.block != 1 or not all(isinstance(a, Fixed) for a in ins[:firsts]):
        raise NotPerExample("a kernel reads its grid's indices or an example's several rows from the batch")
    if mapping.num_scratch_operands:
        raise NotPerExample("a kernel keeps scratch memory from one cell of its grid to the next")
    operands = ins[firsts:firsts + mapping.num_inputs]
    blocks = mapping.block_mappings
    steps = {_grid_axis(blocks[k], per.dim, len(mapping.grid))
             for k, a in enumerate(operands) if isinstance(a, PerExample)}
    axis = steps.pop() if len(steps) == 1 else None
    if axis is None:
        raise NotPerExample("a kernel's cells do not each see one example of every per-example operand")
    for k, a in enumerate(operands):
        if isinstance(a, Fixed) and axis in _grid_axes_read(blocks[k].index_map_jaxpr.jaxpr, len(mapping.grid)):
            raise NotPerExample("a kernel pairs each example with a different block of a value that does not come "
                                "from the batch")
    if _reads_grid(eqn.params["jaxpr"], axis):
        raise NotPerExample("a kernel reads where in the batch its example sits (program_id or num_programs)")
    outs = []
    for block in blocks[mapping.num_inputs:mapping.num_inputs + mapping.num_outputs]:
        dims = [d for d in range(len(block.block_shape)) if _grid_axis(block, d, len(mapping.grid)) == axis]
        if len(dims) != 1:
            raise NotPerExample("a kernel writes blocks that do not hold one example each")
        outs.append(PerExample(dims[0]))
    return outs


def _grid_axis(block: Any, dim: int, axes: int) -> int | None:
    """The grid axis that picks ``block``'s one-element block along ``dim`` (its index there), or None."""
    if type(block.block_shape[dim]).__name__ != "Squeezed" and getattr(block.block_shape[dim], "block_size", 0) != 1:
        return None
    jaxpr = block.index_map_jaxpr.jaxpr
    out = jaxpr.outvars[dim]
    grid = jaxpr.invars[:axes]
    return grid.index(out) if out in grid else None


def _grid_axes_read(jaxpr: Any, axes: int) -> set[int]:
    """The grid axes an index map's outputs depend on."""
    depends = {v: {i} for i, v in enumerate(jaxpr.invars[:axes])}
    for e in jaxpr.eqns:
        read = set().union(*(depends.get(v, set()) for v in e.invars if not hasattr(v, "val")))
        for v in e.outvars:
            depends[v] = read
    return set().union(*(depends.get(v, set()) for v in jaxpr.outvars if not hasattr(v, "val")))


def _reads_grid(jaxpr: Any, axis: int) -> bool:
    """Whether a kernel's body reads the index or the size of grid ``axis``."""
    return any((e.primitive.name in ("program_id", "num_programs") and int(e.params["axis"]) == axis)
               or any(_reads_grid(inner, axis) for inner in sub_jaxprs(e)) for e in jaxpr.eqns)
