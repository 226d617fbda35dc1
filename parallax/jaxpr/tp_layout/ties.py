"""How reshapes, gathers and along-an-axis ops tie the dims of their operands and results."""

from __future__ import annotations

from typing import Any

from parallax.jaxpr.tp_layout.graph import DimGraph, is_var, shape_of


def reshape_ties(graph: DimGraph, src: Any, dst: Any) -> None:
    """Ties the major dim of each group of dims a reshape merges or splits."""
    a, b = shape_of(src), shape_of(dst)
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


def gather_ties(graph: DimGraph, eqn: Any, invars: list, outvars: list, reduced: set) -> None:
    operand, indices = invars[0], invars[1]
    out = outvars[0]
    dnums = eqn.params["dimension_numbers"]
    slice_sizes = eqn.params["slice_sizes"]
    offset_dims = tuple(dnums.offset_dims)
    collapsed = tuple(dnums.collapsed_slice_dims)
    operand_batching = tuple(getattr(dnums, "operand_batching_dims", ()) or ())
    indices_batching = tuple(getattr(dnums, "start_indices_batching_dims", ()) or ())
    out_shape = shape_of(out)
    batch_positions = [d for d in range(len(out_shape)) if d not in offset_dims]
    if is_var(indices):
        for k, d in enumerate(batch_positions):
            if k < len(shape_of(indices)) - 1:
                graph.tie(indices, k, out, d)
    if not is_var(operand):
        return
    for od, idd in zip(operand_batching, indices_batching):
        if is_var(indices):
            graph.tie(operand, od, indices, idd)
    kept = [d for d in range(len(shape_of(operand))) if d not in collapsed and d not in operand_batching]
    for d, position in zip(kept, offset_dims):
        if slice_sizes[d] == shape_of(operand)[d]:
            graph.tie(operand, d, out, position)
    for d in dnums.start_index_map:
        graph.note_role(operand, d, "vocab")
        reduced.add((id(operand), d))


def along_axis_ties(graph: DimGraph, eqn: Any, invars: list, outvars: list) -> None:
    name, params = eqn.primitive.name, eqn.params
    src_list = [v for v in invars if is_var(v)]
    for src in src_list:
        for out in outvars:
            if not is_var(out) or len(shape_of(out)) != len(shape_of(src)):
                continue
            for d in range(len(shape_of(out))):
                if name == "sort":
                    keep = d != params["dimension"]
                elif name == "split":
                    keep = d != params["axis"]
                elif name == "top_k":
                    keep = d != len(shape_of(out)) - 1
                else:
                    keep = (params["window_dimensions"][d] == 1 and params["window_strides"][d] == 1
                            and tuple(params["padding"][d]) == (0, 0))
                if keep and shape_of(src)[d] == shape_of(out)[d]:
                    graph.tie(src, d, out, d)


# --- choosing the classes ---------------------------------------------------------------------
