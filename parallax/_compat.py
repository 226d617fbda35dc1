"""The one place where the two tested JAX stacks differ, and the JAX calls most likely to.

Tested stacks (``make test`` / ``make test-latest``): jax/jaxlib 0.10.2 with flax 0.12.8 on
Python 3.11, and jax/jaxlib 0.12.x with flax 0.12.12+ on Python 3.12. Everything else in
parallax calls JAX directly; what changed between minor releases, or is the most likely to
change next (``shard_map``'s signature, how meshes are built, the text XLA prints for
collectives), goes through here, so a new release means editing one file.

Known differences:

* The compiled HLO text prints a collective's ``replica_groups`` as an explicit list
  (``{{0,1},{2,3}}``) or an iota (``[4,2]<=[8]``) on jaxlib 0.10, and, on jaxlib 0.12, for
  collectives that ``shard_map`` emits, as mesh axes (``mesh['data'=2,'fsdp'=4] {'fsdp'}``), with
  the mesh's devices in another order where they are (``mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0))
  {'a'}``, jaxlib 0.10 too). :func:`replica_group_size` and :func:`replica_groups` read them all.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

_GROUPS_LIST = re.compile(r"replica_groups=\{\{([0-9,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[(?P<axes>[^\]]*)\](?:,\s*device_ids=\((?P<ids>[^)]*\)?)\))?"
                          r"\s*\{(?P<over>[^}]*)\}")
_IDS_IOTA = re.compile(r"^\[(?P<shape>[\d,]+)\](?:<=\[(?P<dims>[\d,]+)\])?(?:T\((?P<perm>[\d,]+)\))?$")
_MESH_AXIS = re.compile(r"'([^']+)'=(\d+)")


def replica_group_size(hlo_line: str) -> int:
    """How many devices take part in each group of the collective on one HLO line.

    Example:
        >>> replica_group_size("x = all-reduce(y), replica_groups={{0,2},{1,3}}")
        2
        >>> replica_group_size("x = all-gather(y), replica_groups=[2,4]<=[8], dimensions={0}")
        4
        >>> replica_group_size("x = reduce-scatter(y), replica_groups=mesh['data'=2,'fsdp'=4] {'fsdp'}")
        4
        >>> replica_group_size("x = all-gather(y), replica_groups=mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'a'}")
        2
    """
    listed = _GROUPS_LIST.search(hlo_line)
    if listed:
        return len(listed.group(1).split(","))
    iota = _GROUPS_IOTA.search(hlo_line)
    if iota:
        return int(iota.group(2))
    by_mesh = _GROUPS_MESH.search(hlo_line)
    if by_mesh:
        sizes = {name: int(size) for name, size in _MESH_AXIS.findall(by_mesh.group("axes"))}
        size = 1
        for name in re.findall(r"'([^']+)'", by_mesh.group("over")):
            size *= sizes[name]
        return size
    return 1


_GROUPS_ALL_LISTED = re.compile(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}")
_GROUPS_IOTA_FULL = re.compile(r"replica_groups=\[(?P<shape>[\d,]+)\]<=\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


def replica_groups(hlo_line: str, devices: int) -> list[tuple[int, ...]]:
    """The device groups (partition ids: positions in the mesh's device order) of the collective
    on one HLO line, in every form XLA prints: explicit lists, iotas (with a transpose), mesh
    axes, a permute's source-target pairs; one group of all ``devices`` where none is printed.

    Example:
        >>> replica_groups("x = all-reduce(y), replica_groups={{0,2},{1,3}}", 4)
        [(0, 2), (1, 3)]
        >>> replica_groups("x = all-gather(y), replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}", 8)
        [(0, 2, 4, 6), (1, 3, 5, 7)]
        >>> replica_groups("x = reduce-scatter(y), replica_groups=mesh['data'=2,'fsdp'=4] {'data'}", 8)
        [(0, 4), (1, 5), (2, 6), (3, 7)]
        >>> replica_groups("x = all-gather(y), replica_groups=mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'a'}", 8)
        [(0, 1), (2, 3), (4, 5), (6, 7)]
        >>> replica_groups("x = collective-permute(y), source_target_pairs={{0,1},{1,0}}", 2)
        [(0, 1), (1, 0)]
    """
    pairs = _PAIRS.search(hlo_line)
    if pairs:
        return [tuple(int(v) for v in pair.split(",")) for pair in re.findall(r"\{(\d+,\d+)\}", pairs.group(1))]
    listed = _GROUPS_ALL_LISTED.search(hlo_line)
    if listed and listed.group(1):
        return [tuple(int(v) for v in group.split(",") if v) for group in re.findall(r"\{([0-9,]*)\}", listed.group(1))]
    iota = _GROUPS_IOTA_FULL.search(hlo_line)
    if iota:
        shape = [int(v) for v in iota.group("shape").split(",")]
        dims = [int(v) for v in iota.group("dims").split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if iota.group("perm"):
            ids = ids.transpose([int(v) for v in iota.group("perm").split(",")])
        return [tuple(int(v) for v in row) for row in ids.reshape(shape[0], -1)]
    by_mesh = _GROUPS_MESH.search(hlo_line)
    if by_mesh:
        axes = _MESH_AXIS.findall(by_mesh.group("axes"))
        names, sizes = [name for name, _ in axes], [int(size) for _, size in axes]
        over = [names.index(name) for name in re.findall(r"'([^']+)'", by_mesh.group("over"))]
        ids = _mesh_device_ids(by_mesh.group("ids"), int(np.prod(sizes))).reshape(sizes)
        ids = np.moveaxis(ids, over, range(len(sizes) - len(over), len(sizes)))
        return [tuple(int(v) for v in row)
                for row in ids.reshape(-1, int(np.prod([sizes[i] for i in over], dtype=int)))]
    return [tuple(range(devices))]


def _mesh_device_ids(printed: str | None, count: int) -> np.ndarray:
    """The partition ids of a mesh-axes replica group's devices, in the mesh's order: ``device_ids=``'s
    iota (``[4,2]T(1,0)``, ``[2,4]<=[8]``) or list (``0,4,1,5``); ``0..count-1`` where none is printed.

    Example:
        >>> _mesh_device_ids("[4,2]T(1,0)", 8).tolist()
        [0, 2, 4, 6, 1, 3, 5, 7]
    """
    if not printed:
        return np.arange(count)
    iota = _IDS_IOTA.match(printed.strip())
    if iota is None:
        return np.array([int(v) for v in re.findall(r"\d+", printed)])
    shape = [int(v) for v in iota.group("shape").split(",")]
    dims = [int(v) for v in iota.group("dims").split(",")] if iota.group("dims") else shape
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if iota.group("perm"):
        ids = ids.transpose([int(v) for v in iota.group("perm").split(",")])
    return ids.reshape(-1)


def auto_mesh(shape: Sequence[int], names: Sequence[str], devices: Sequence[Any]) -> Mesh:
    """A mesh of ``devices`` in topology order whose axes are all ``AxisType.Auto``.

    ``jax.make_mesh`` makes Explicit axes since jax 0.7, which break the FSDP recipe, GSPMD
    matmuls and linen ``Partitioned.unbox()``; this builds the mesh the way both stacks agree on.
    """
    try:
        device_grid = mesh_utils.create_device_mesh(tuple(shape), list(devices))
    except (ValueError, NotImplementedError, AssertionError):
        # Topologies mesh_utils does not know (e.g. mixed device kinds): keep the given order.
        device_grid = np.asarray(list(devices), dtype=object).reshape(tuple(shape))
    return Mesh(device_grid, tuple(names), axis_types=(AxisType.Auto,) * len(names))


@contextlib.contextmanager
def mesh_context(mesh: Mesh) -> Iterator[None]:
    """``jax.set_mesh(mesh)``, or inside a trace (``jit``, ``eval_shape``), where ``set_mesh`` is
    refused, the abstract mesh alone (what bare ``PartitionSpec`` s resolve against)."""
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(jax.set_mesh(mesh))
        except ValueError:  # "`set_mesh` can only be used outside of `jax.jit`"
            stack.enter_context(jax.sharding.use_abstract_mesh(mesh.abstract_mesh))
        yield


def shard_map(fn: Callable, *, mesh: Mesh, in_specs: Any, out_specs: Any, manual_axes: set[str]) -> Callable:
    """``jax.shard_map`` manual over ``manual_axes`` (the others stay automatic).

    ``check_vma=False`` always: with it on, the gradient of a replicated input comes back
    already summed over the axis, and parallax synchronises gradients itself.
    """
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=set(manual_axes),
                         check_vma=False)


def scan_counts(params: dict) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a ``scan`` equation's params.

    jax 0.10 names them; jax 0.12 gives the flat tree of the operands instead
    (``ft_in``: a ``(consts, carry, xs)`` tuple of groups, one entry per leaf).
    """
    if "num_consts" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    flat = params["ft_in"]
    groups = flat.unpack() if hasattr(flat, "unpack") else tuple(flat)

    def leaves(group) -> int:
        return len(list(group.vals)) if hasattr(group, "vals") else len(group)

    return leaves(groups[0]), leaves(groups[1])


def source_line(eqn: Any) -> str | None:
    """Where the user's code made a traced equation: ``file:line:column (function)``, the innermost
    frame outside JAX (``None`` where this JAX does not say)."""
    try:
        from jax._src import source_info_util  # private: no public way names an equation's source

        found = source_info_util.summarize(eqn.source_info)
    except Exception:
        return None
    return None if not found or found.startswith("unknown") else found


def traced_at(eqn: Any) -> contextlib.AbstractContextManager:
    """A context in which what is traced records ``eqn``'s source (the user's line) as its own: an
    equation bound again by a run change keeps pointing at the model's code."""
    try:
        from jax._src import source_info_util  # private: no public way sets a traced value's source

        return source_info_util.user_context(eqn.source_info.traceback)
    except Exception:
        return contextlib.nullcontext()
