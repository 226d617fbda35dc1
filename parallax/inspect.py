"""Where memory and bandwidth go: per-device bytes and collective traffic of a step.

Both come from the compiled computation, so they are exact and do not depend on how
busy the machine is.

Example:
    >>> compiled = step.lower(state, batch).compile()
    >>> traffic = collective_bytes(compiled.as_text())  # kind -> CollectiveStat(count, bytes)
    >>> sum(stat.bytes for stat in traffic.values()) > 0
    True
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax

from parallax._compat import replica_group_size, replica_groups

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1,
}
_SHAPE = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([0-9,]*)\]")
_MOVE = re.compile(r"= (\w+)\[([\d,]*)\]\{([\d,]*)[^}]*\} (copy|transpose)\(")
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_OP = re.compile(r"=\s*(?P<result>.*?)\s(?P<op>" + "|".join(COLLECTIVES)
                 + r")(?P<start>-start)?\((?P<operands>[^)]*)\)")


_HEADER = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\((?P<params>.*)\)\s*->.*\{\s*$")
_CALLEE = re.compile(r"\b(?P<role>body|condition|calls|to_apply|true_computation|false_computation)"
                     r"=%?(?P<name>[\w.\-]+)")
_BRANCHES = re.compile(r"(?:branch_computations|called_computations)=\{(?P<names>[^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_DEFINED = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<dtype>\w+)\[(?P<dims>[\d,]*)\]")
_PARAM = re.compile(r"%?(?P<name>[\w.\-]+):\s*(?P<dtype>\w+)\[(?P<dims>[\d,]*)\]")
_DOT = re.compile(r"\sdot\(%?(?P<lhs>[\w.\-]+),.*?lhs_contracting_dims=\{(?P<contracting>[\d,]*)\}")


_BOUND = re.compile(r"compare\(%?[\w.-]+, %?(?P<name>[\w.-]+)\), direction=LT")


def _condition_bound(bodies: dict[str, list[str]], condition: str | None) -> int:
    """A loop's trip count from its condition where XLA printed none (the TPU compiler): the
    constant its counter is compared below (a scan's counter starts at 0); 1 where not read."""
    lines = bodies.get(condition or "", [])
    compare = next((m for m in map(_BOUND.search, lines) if m), None)
    if compare is None:
        return 1
    constant = re.compile(rf"%?{re.escape(compare.group('name'))} = s32\[\][^ ]* constant\((\d+)\)")
    found = next((m for m in map(constant.search, lines) if m), None)
    return int(found.group(1)) if found else 1


def lines_with_runs(hlo_text: str) -> list[tuple[str, int, int]]:
    """Each line of a compiled program with how many times it runs per call of the program and
    at how many places it is called: a ``while`` loop's body (with the trip count XLA proved,
    ``known_trip_count``) runs that many times for one call site. Lines outside any computation
    (a fragment) run once.

    Example:
        >>> text = jax.jit(lambda w, x: jax.lax.scan(lambda h, wl: (h @ wl, None), x, w)[0]).lower(
        ...     jnp.ones((8, 4, 4)), jnp.ones((2, 4))).compile().as_text()
        >>> max(runs for line, runs, _ in lines_with_runs(text) if " dot(" in line)
        8
    """
    computations: list[tuple[str, list[str]]] = []
    loose: list[str] = []
    current = None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = (header.group("name"), [line])
            computations.append(current)
        elif current is not None and line.startswith("}"):
            current = None
        elif current is not None:
            current[1].append(line)
        else:
            loose.append(line)
    if not computations:
        return [(line, 1, 1) for line in loose]
    runs: dict[str, int] = {computations[-1][0]: 1}  # the entry computation is printed last
    sites: dict[str, int] = {computations[-1][0]: 1}
    bodies = dict(computations)
    for name, lines in reversed(computations):  # callers are printed after their callees
        for line in lines[1:]:
            callees = [(m.group("role"), m.group("name")) for m in _CALLEE.finditer(line)]
            trip = _TRIP.search(line)
            count = int(trip.group(1)) if trip else _condition_bound(bodies, dict(callees).get("condition"))
            for group in _BRANCHES.finditer(line):
                callees += [("branch", n.strip().lstrip("%")) for n in group.group("names").split(",") if n.strip()]
            for role, callee in callees:
                factor = count if role in ("body", "condition") else 1
                runs[callee] = runs.get(callee, 0) + runs.get(name, 0) * factor
                sites[callee] = sites.get(callee, 0) + sites.get(name, 0)
    return [(line, runs.get(name, 0), sites.get(name, 0)) for name, lines in computations for line in lines]


def loop_dot_flops(hlo_text: str) -> float:
    """The FLOPs of the matmuls (``dot``) a program runs in its loops beyond what counting each
    call site once gives: what ``cost_analysis()``, which counts a loop's body once, leaves out."""
    extra = 0.0
    shapes: dict[str, list[int]] = {}
    for line, runs, sites in lines_with_runs(hlo_text):
        header = _HEADER.match(line)
        if header:
            shapes = {m.group("name"): [int(d) for d in m.group("dims").split(",") if d]
                      for m in _PARAM.finditer(header.group("params"))}
            continue
        defined = _DEFINED.match(line)
        if defined:
            shapes[defined.group("name")] = [int(d) for d in defined.group("dims").split(",") if d]
        dot = _DOT.search(line) if runs > sites else None
        if dot is None or defined is None or dot.group("lhs") not in shapes:
            continue
        lhs = shapes[dot.group("lhs")]
        contracted = 1
        for d in filter(None, dot.group("contracting").split(",")):
            contracted *= lhs[int(d)]
        result = 1
        for d in shapes[defined.group("name")]:
            result *= d
        extra += (runs - sites) * 2.0 * result * contracted
    return extra


@dataclasses.dataclass(frozen=True)
class CollectiveStat:
    """How many collectives of one kind a step runs, and the bytes they move per device."""

    count: int = 0
    bytes: int = 0


def _shape_sizes(text: str) -> list[int]:
    """The bytes of each array shape written in ``text``, in order."""
    sizes = []
    for dtype, dims in _SHAPE.findall(text):
        size = 1
        for d in filter(None, dims.split(",")):
            size *= int(d)
        sizes.append(size * _DTYPE_BYTES[dtype])
    return sizes


def _moved(kind: str, started: bool, result: str) -> list[int]:
    """The result shapes that count for one collective. An async ``-start`` op's result is a
    tuple that also holds its operands (and, for a permute, two ``u32[]`` sync flags)."""
    sizes = _shape_sizes(result)
    if started and kind in ("all-gather", "reduce-scatter", "all-to-all") and len(sizes) > 1:
        return sizes[len(sizes) // 2:]  # ((operands...), results...): XLA:GPU's async forms
    if started and kind == "collective-permute":
        return sizes[:1]  # (operand, result, u32[], u32[])
    return sizes


def collective_bytes(hlo_text: str) -> dict[str, CollectiveStat]:
    """Counts collectives in compiled HLO text and the bytes each kind moves.

    Each collective counts the size of the whole array taking part, per device: an
    all-gather its (gathered) result, a reduce-scatter its (unscattered) operand, an
    all-reduce, all-to-all or permute its operand. Replica groups are read in every form
    XLA prints (explicit lists, iota ``[2,4]<=[8]``, mesh axes), and the async ``-start``
    forms count what their synchronous forms do. A collective inside a loop counts once per
    iteration (:func:`lines_with_runs`): a pipeline's permute, a scanned stack's gathers.

    Example:
        >>> line = "ag = (f32[16]{0}, f32[128]{0}) all-gather-start(f32[16]{0} p), replica_groups=[1,8]<=[8]"
        >>> collective_bytes(line)["all-gather"]
        CollectiveStat(count=1, bytes=512)
        >>> line = "rs = ((f32[128]{0}), f32[16]{0}) reduce-scatter-start(f32[128]{0} g), replica_groups=[1,8]<=[8]"
        >>> collective_bytes(line)["reduce-scatter"]
        CollectiveStat(count=1, bytes=512)
    """
    stats = {kind: CollectiveStat() for kind in COLLECTIVES}
    for line, runs, _ in lines_with_runs(hlo_text):
        match = _OP.search(line)
        if match is None:
            continue
        kind = match.group("op")
        moved = sum(_moved(kind, match.group("start") is not None, match.group("result")))
        if kind == "reduce-scatter":
            moved *= replica_group_size(line)
        old = stats[kind]
        stats[kind] = CollectiveStat(old.count + runs, old.bytes + moved * runs)
    return stats


def collective_groups(hlo_text: str, devices: int) -> list[tuple[str, int, int, list[tuple[int, ...]]]]:
    """Each collective of a compiled program as ``(kind, runs, bytes, groups)``: how many times it
    runs per call of the program, the bytes it moves per device in all those runs (as
    :func:`collective_bytes` counts them) and its device groups, as partition ids (positions in
    the mesh's ``devices.flat``).

    The program is the same whichever devices fill a mesh of its shape, so one compile tells
    what every layout of the devices over hosts would move across them.
    """
    found = []
    for line, runs, _ in lines_with_runs(hlo_text):
        match = _OP.search(line)
        if match is not None:
            kind = match.group("op")
            found.append((kind, runs, collective_bytes(line)[kind].bytes * runs, replica_groups(line, devices)))
    return found


def _spans(groups: list[tuple[int, ...]], hosts: list[int]) -> bool:
    return any(len({hosts[i] for i in group}) > 1 for group in groups)


def collective_bytes_by_link(hlo_text: str, hosts: Any) -> dict[str, dict[str, CollectiveStat]]:
    """:func:`collective_bytes` split by the links each collective runs over: ``"inside"`` where
    every device group lies in one host, ``"across"`` where a group spans hosts.

    Args:
        hlo_text: the compiled program's text.
        hosts: the host of each device in the program's order (its mesh's ``devices.flat``;
            :func:`parallax.sharding.topology.hosts_of`).

    Example:
        >>> line = "ag = f32[128]{0} all-gather(f32[16]{0} p), replica_groups=[2,4]<=[8], dimensions={0}"
        >>> collective_bytes_by_link(line, [0, 0, 0, 0, 1, 1, 1, 1])["inside"]["all-gather"]
        CollectiveStat(count=1, bytes=512)
        >>> collective_bytes_by_link(line, [0, 1, 0, 1, 0, 1, 0, 1])["across"]["all-gather"].bytes
        512
    """
    hosts = [int(h) for h in hosts]
    split = {link: {kind: CollectiveStat() for kind in COLLECTIVES} for link in ("inside", "across")}
    for kind, runs, moved, groups in collective_groups(hlo_text, len(hosts)):
        link = "across" if _spans(groups, hosts) else "inside"
        split[link][kind] = CollectiveStat(split[link][kind].count + runs, split[link][kind].bytes + moved)
    return split


def across_bytes(collectives: list[tuple[str, int, int, list[tuple[int, ...]]]], hosts: Any) -> int:
    """The bytes of :func:`collective_groups`' collectives whose device groups span hosts, with
    ``hosts`` the host of each device in the program's order."""
    hosts = [int(h) for h in hosts]
    return sum(moved for _, _, moved, groups in collectives if _spans(groups, hosts))


def memory_bytes(compiled: Any) -> dict[str, int]:
    """Per-device bytes of a compiled computation in device memory: ``arguments``, ``outputs``,
    ``temporaries``, ``aliased`` (donated); and ``host``: the largest of its arguments and outputs
    in host memory (state offloaded to ``pinned_host``).

    A GPU or TPU backend reports host bytes apart; the CPU backend has one memory and reports
    them with the rest, so there the host-resident arguments and outputs (memory space
    ``S(5)`` in the compiled program's entry layout) are subtracted here.
    """
    analysis = compiled.memory_analysis()
    memory = {
        "arguments": int(analysis.argument_size_in_bytes),
        "outputs": int(analysis.output_size_in_bytes),
        "temporaries": int(analysis.temp_size_in_bytes),
        "aliased": int(analysis.alias_size_in_bytes),
    }
    reported = (int(getattr(analysis, "host_argument_size_in_bytes", 0) or 0),
                int(getattr(analysis, "host_output_size_in_bytes", 0) or 0))
    if any(reported):
        return {**memory, "host": max(reported)}
    args, outs, aliases = _entry_layout(compiled.as_text().split("\n", 1)[0])
    host_aliased = sum(outs[out] for out, param in aliases if out < len(outs) and param < len(args) and args[param])
    return {"arguments": memory["arguments"] - sum(args), "outputs": memory["outputs"] - sum(outs),
            "temporaries": memory["temporaries"], "aliased": memory["aliased"] - host_aliased,
            "host": max(sum(args), sum(outs))}


_LAYOUT_SHAPE = re.compile(r"\b(?P<dtype>" + "|".join(_DTYPE_BYTES)
                           + r")\[(?P<dims>[\d,]*)\](?:\{(?P<layout>[^}]*)\})?")


def _entry_layout(header: str) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    """From an HLO module's header line: per argument and per output, its bytes if it lives in
    host memory (``S(5)``) else 0; and the (output, parameter) pairs that alias."""
    start = header.find("entry_computation_layout={")
    if start < 0:
        return [], [], []
    depth, first = 0, start + len("entry_computation_layout=")
    for index in range(first, len(header)):
        depth += {"{": 1, "}": -1}.get(header[index], 0)
        if depth == 0:
            break
    layout = header[start + len("entry_computation_layout={"):index]
    args_text, _, outs_text = layout.partition(")->")

    def host_sizes(text: str) -> list[int]:
        sizes = []
        for match in _LAYOUT_SHAPE.finditer(text):
            if "S(5)" in (match.group("layout") or ""):
                sizes.extend(_shape_sizes(match.group(0)))
            else:
                sizes.append(0)
        return sizes

    aliases = [(int(out or 0), int(param)) for out, param in re.findall(r"\{(\d*)\}: \((\d+), \{\}", header)]
    return host_sizes(args_text), host_sizes(outs_text), aliases


def peak_bytes(memory: dict[str, int]) -> int:
    """Arguments + outputs - donated + temporaries, from :func:`memory_bytes`: what one device holds at most."""
    return memory["arguments"] + memory["outputs"] - memory["aliased"] + memory["temporaries"]


def layout_bytes(hlo_text: str) -> int:
    """Bytes of the physical transposes in a compiled program (inside fusions too): a ``copy``
    into another layout, or a ``transpose`` whose result has the default (row-major) layout.

    ``cost_analysis`` counts a fusion's bytes at its boundary, so a transpose fused into an
    elementwise op costs nothing there; on real memory it is a strided pass over the array.
    A ``transpose`` into a non-default layout is a relabelling (a bitcast) and is not counted.
    """
    total = 0
    for dtype, dims, layout, op in _MOVE.findall(hlo_text):
        shape = [int(d) for d in dims.split(",") if d]
        if len(shape) < 2 or dtype not in _DTYPE_BYTES:
            continue
        default = ",".join(str(d) for d in reversed(range(len(shape))))
        if op == "copy" or layout == default:
            total += _shape_sizes(f"{dtype}[{dims}]")[0]
    return total


def state_bytes_per_device(state: Any) -> int:
    """Bytes of ``state`` held by the first device (every device holds the same share)."""
    device = jax.devices()[0]
    total = 0
    for leaf in jax.tree.leaves(state):
        for shard in leaf.addressable_shards:
            if shard.device == device:
                total += shard.data.nbytes
    return total
