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

from parallax._compat import replica_group_size

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1,
}
_SHAPE = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([0-9,]*)\]")
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_OP = re.compile(r"=\s*(?P<result>.*?)\s(?P<op>" + "|".join(COLLECTIVES) + r")(?:-start)?\((?P<operands>[^)]*)\)")


@dataclasses.dataclass(frozen=True)
class CollectiveStat:
    """How many collectives of one kind a step runs, and the bytes they move per device."""

    count: int = 0
    bytes: int = 0


def _shape_bytes(text: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        size = 1
        for d in filter(None, dims.split(",")):
            size *= int(d)
        total += size * _DTYPE_BYTES[dtype]
    return total


def collective_bytes(hlo_text: str) -> dict[str, CollectiveStat]:
    """Counts collectives in compiled HLO text and the bytes each kind moves.

    Each collective counts the size of the whole array taking part, per device: an
    all-gather its (gathered) result, a reduce-scatter its (unscattered) operand, an
    all-reduce, all-to-all or permute its operand.
    """
    stats = {kind: CollectiveStat() for kind in COLLECTIVES}
    for line in hlo_text.splitlines():
        match = _OP.search(line)
        if match is None:
            continue
        kind = match.group("op")
        moved = _shape_bytes(match.group("result"))
        if kind == "reduce-scatter":
            moved *= replica_group_size(line)
        old = stats[kind]
        stats[kind] = CollectiveStat(old.count + 1, old.bytes + moved)
    return stats


def memory_bytes(compiled: Any) -> dict[str, int]:
    """Per-device bytes of a compiled computation: arguments, outputs, temporaries."""
    analysis = compiled.memory_analysis()
    return {
        "arguments": int(analysis.argument_size_in_bytes),
        "outputs": int(analysis.output_size_in_bytes),
        "temporaries": int(analysis.temp_size_in_bytes),
        "aliased": int(analysis.alias_size_in_bytes),
    }


def state_bytes_per_device(state: Any) -> int:
    """Bytes of ``state`` held by the first device (every device holds the same share)."""
    device = jax.devices()[0]
    total = 0
    for leaf in jax.tree.leaves(state):
        for shard in leaf.addressable_shards:
            if shard.device == device:
                total += shard.data.nbytes
    return total
