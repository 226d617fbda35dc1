"""Involuntary full rematerialization: the tensors the compiler replicated to reshard them.

When GSPMD finds no efficient way from one sharding of a tensor to another, it replicates the
tensor on every device and slices the target out of it, and says so only on stderr
(``[SPMD] Involuntary full rematerialization ... SPMD will replicate the tensor and then
partition it``). The result is exact, but the step pays for the copies. :func:`compile_reporting`
compiles a lowered step while reading what the compiler writes to stderr, and returns each such
resharding as a :class:`Resharding`: the tensor's shape, the operation that made it (from the
HLO metadata: the JAX op path, which names the module), and the two shardings. Everything else
the compiler wrote is passed on to stderr unchanged.

Example:
    >>> text = ("W1124 spmd_partitioner.cc:656] [SPMD] Involuntary full rematerialization. The compiler "
    ...         "cannot go from sharding {devices=[8,1]<=[8]} to {devices=[1,4,2]<=[2,4]T(1,0) "
    ...         "last_tile_dim_replicate} efficiently for HLO operation %select_n.27 = f32[8,768]{1,0} "
    ...         'select(%a, %b, %c), metadata={op_name="jit(train_step)/transpose(jvp(Stack))/select_n"}. '
    ...         "As the last resort, SPMD will replicate the tensor and then partition it")
    >>> print(parse(text)[0].describe())
    f32[8,768] at jit(train_step)/transpose(jvp(Stack))/select_n: {devices=[8,1]<=[8]} -> {devices=[1,4,2]<=[2,4]T(1,0) last_tile_dim_replicate}
"""  # noqa: E501 (a doctest's output)

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pathlib
import re
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import jax

from parallax._tree import path_str
from parallax.sharding.specs import is_spec

MARKER = "Involuntary full rematerialization"
_MESSAGE = re.compile(r"cannot go from sharding (\{.*?\}) to (\{.*?\}) efficiently for HLO operation "
                      r"%?(\S+) = (\w+\[[^\]]*\])")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_LOCK = threading.Lock()  # one redirection of the process's stderr at a time


@dataclasses.dataclass(frozen=True)
class Resharding:
    """One tensor the compiler replicated to reshard it.

    Attributes:
        shape: its per-device shape as HLO writes it (``f32[2,8,32]``).
        op: the JAX operation that produced it (``jit(train_step)/jvp(GPT2)/.../dot_general``), or
            the HLO instruction's name where the compiler gave no metadata.
        source: the sharding it had.
        target: the sharding it was needed in.
        suspects: the params whose layout asks for the target: split over a mesh axis of the
            size the target splits a dim into, along a dim of that dim's global size (paths).
    """

    shape: str
    op: str
    source: str
    target: str
    suspects: tuple[str, ...] = ()

    def describe(self) -> str:
        text = f"{self.shape} at {self.op}: {self.source} -> {self.target}"
        return text + (f" (asked for by the layout of {', '.join(self.suspects[:4])})" if self.suspects else "")


def _tiles(sharding: str, rank: int) -> list[int]:
    """How many pieces an HLO sharding cuts each of ``rank`` dims into (1 where it does not): GSPMD's
    ``{devices=[8,1]<=[8]}`` or Shardy's ``{mesh['data'=2,'fsdp'=4], [{'data', 'fsdp'}, {}]}``."""
    found = re.search(r"devices=\[([\d,]+)\]", sharding)
    if found is not None:
        return ([int(x) for x in found.group(1).split(",")] + [1] * rank)[:rank]
    sizes = {name: int(size) for name, size in re.findall(r"'([^']+)'=(\d+)", sharding)}
    dims = re.search(r"\[(\{.*\})\]", sharding)
    if not sizes or dims is None:
        return [1] * rank
    tiles = []
    for axes in re.findall(r"\{([^}]*)\}", dims.group(1)):
        pieces = 1
        for name in re.findall(r"'([^']+)'", axes):
            pieces *= sizes.get(name, 1)
        tiles.append(pieces)
    return (tiles + [1] * rank)[:rank]


def _shape_dims(shape: str) -> list[int]:
    inside = shape[shape.index("[") + 1:shape.rindex("]")]
    return [int(x) for x in inside.split(",") if x.strip().isdigit()]


def suspects(found: Resharding, params: Any, specs: Any, mesh: Any) -> tuple[str, ...]:
    """The params whose split matches what ``found``'s target asks of a dim (see :class:`Resharding`)."""
    if found.shape == "?":
        return ()
    local = _shape_dims(found.shape)
    source, target = _tiles(found.source, len(local)), _tiles(found.target, len(local))
    wanted = {(size * pieces, cut) for size, pieces, cut in zip(local, source, target) if cut > 1}
    names = []
    shapes = jax.tree.leaves_with_path(params)
    for (path, value), spec in zip(shapes, jax.tree.leaves(specs, is_leaf=is_spec)):
        for size, entry in zip(getattr(value, "shape", ()), spec):
            axes = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
            pieces = 1
            for axis in axes:
                pieces *= mesh.shape[axis]
            if axes and (size, pieces) in wanted:
                names.append(path_str(path))
                break
    return tuple(names)


def parse(text: str) -> list[Resharding]:
    """Every distinct involuntary full rematerialization the compiler reported in ``text``."""
    found: dict[Resharding, None] = {}
    for line in text.splitlines():
        if MARKER not in line:
            continue
        match = _MESSAGE.search(line)
        if match is None:  # a message in another wording: keep what it says
            found[Resharding("?", line.split(MARKER, 1)[-1].strip()[:200], "?", "?")] = None
            continue
        source, target, instruction, shape = match.groups()
        op = _OP_NAME.search(line)
        found[Resharding(shape, op.group(1) if op else instruction, source, target)] = None
    return list(found)


@contextlib.contextmanager
def _stderr_to(path: str) -> Iterator[None]:
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to read (a daemon): compile without reading the report
        yield
        return
    with open(path, "wb") as sink:
        os.dup2(sink.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def compile_reporting(lowered: Any, params: Any = None, specs: Any = None,
                      mesh: Any = None) -> tuple[Any, list[Resharding]]:
    """``lowered.compile()``, and the reshardings the compiler reported while compiling it
    (with their :func:`suspects` among ``params`` laid out by ``specs`` on ``mesh``, when given).

    What else the compiler wrote to stderr is written back to stderr once it is done (also when
    compiling fails); its rematerialization lines too only where the ``parallax`` logger is at
    DEBUG (the step's own warning names each, with the params that ask for it). A program
    served from JAX's persistent compilation cache, or compiled before in this process, is not
    partitioned again and reports nothing.
    """
    with _LOCK, tempfile.TemporaryDirectory() as folder:
        # A planning subprocess names a file of its parent's, which outlives a compiler that aborts.
        path = os.environ.get("PARALLAX_COMPILER_STDERR") or os.path.join(folder, "stderr")
        try:
            with _stderr_to(path):
                compiled = lowered.compile()
        finally:
            text = pathlib.Path(path).read_bytes().decode(errors="replace") if os.path.exists(path) else ""
            shown = text if logging.getLogger("parallax").isEnabledFor(logging.DEBUG) else "".join(
                line for line in text.splitlines(keepends=True) if MARKER not in line)
            if shown:
                sys.stderr.write(shown)
    found = parse(text)
    if params is not None:
        found = [dataclasses.replace(r, suspects=suspects(r, params, specs, mesh)) for r in found]
    return compiled, found


def describe_all(reshardings: list[Resharding], limit: int = 3) -> str:
    """One line naming the first ``limit`` reshardings (and how many more there are)."""
    shown = "; ".join(r.describe() for r in reshardings[:limit])
    more = len(reshardings) - limit
    return shown + (f"; and {more} more" if more > 0 else "")


def avoiding(strategy: Any, mode: str, paths: tuple[str, ...], searched: bool = False) -> str:
    """What lays the step out without such copies, for its warning: the other compile path where the
    loss allows it (``shard_map`` gathers each FSDP param whole before its layer, so no activation is
    resharded), another FSDP split, the search that prices them (unless it ``searched``: the split is
    already the pick of FSDP's ``split='auto'``).

    Example:
        >>> avoiding(px.FSDP(split="output"), "jit", ("jit", "shard_map"))
        "Exact, but each copy costs memory and time. Laid out without them: compile='shard_map' (each FSDP param gathered whole before its layer); FSDP(split='largest') or split='input' (the params named lie along another dim); or FSDP's default split='auto', which prices every split and path"
        >>> avoiding(px.FSDP(split="largest"), "jit", ("jit",), searched=True)  # the split search's own pick
        "Exact, but each copy costs memory and time. Laid out without them: FSDP(split='input') or split='output' (the params named lie along another dim) (FSDP's split='auto' priced them and picked split='largest')"
    """  # noqa: E501 (a doctest's output)
    ways = []
    if mode == "jit" and "shard_map" in paths:
        ways.append("compile='shard_map' (each FSDP param gathered whole before its layer)")
    splits = [part.split for part in getattr(strategy, "parts", ()) if hasattr(part, "split")]
    others = [split for split in ("largest", "input", "output") if splits and split != splits[0]]
    if others:
        named = ", ".join(f"split={split!r}" for split in others[1:-1])
        ways.append(f"FSDP(split={others[0]!r}){', ' + named if named else ''} or split={others[-1]!r} (the params "
                    "named lie along another dim)")
        if splits[0] != "auto" and not searched:
            ways.append("or FSDP's default split='auto', which prices every split and path")
        elif searched:
            ways[-1] += f" (FSDP's split='auto' priced them and picked split={splits[0]!r})"
    if not ways:
        ways.append("another strategy or axis order (strategy='auto' prices every mesh, copies included)")
    return f"Exact, but each copy costs memory and time. Laid out without them: {'; '.join(ways)}"
