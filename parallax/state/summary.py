"""What a sharded state holds: each param's spec and bytes per device, totals, and a lint.

``summarize`` reads a planned state (:class:`parallax.StatePlan`, nothing allocated) or a
built one (:class:`parallax.TrainState`): every param's path, global shape, dtype,
``PartitionSpec`` and bytes per device; totals for params, optimizer state and model state,
per device and global (element counts are global, not per shard). Its lint names the large
params that stay whole on every device and why (below ``min_weight_size``, no divisible dim,
no tensor-parallel rule or derived split), rules that matched nothing, the params the
optimizer never changes (frozen: marked in the table too), and the fraction of state bytes
that is sharded; ``fail_if_replicated_over=`` makes a large replicated param an
error.

Example:
    >>> plan = px.plan_state(model, optax.adam(1e-3), batch, strategy=px.FSDP(min_weight_size=1024),
    ...                      loss_fn=loss_fn)
    >>> summary = px.summarize(plan)
    >>> summary.totals["params"]["count"], summary.lint.replicated
    (5898, ())
    >>> print(summary.as_dict()["params"][0]["spec"])
    [None]
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any, TextIO

import jax
from jax.sharding import NamedSharding

from parallax._tree import path_str
from parallax._units import format_bytes, parse_bytes
from parallax.models import adapter_for
from parallax.sharding import rules as tp_rules
from parallax.sharding.found import NOTHING, Found
from parallax.sharding.strategy import Strategy
from parallax.sharding.topology import describe_hosts
from parallax.state.frozen import frozen_paths
from parallax.state.plan import StatePlan
from parallax.step.train_state import TrainState

PARTS = ("params", "opt_state", "model_state")


class ReplicatedParamError(ValueError):
    """A param larger than ``fail_if_replicated_over`` is whole on every device."""


@dataclasses.dataclass(frozen=True)
class LeafRow:
    """One array of the state: where it lives and what it costs.

    Attributes:
        path: e.g. ``"Dense_0/kernel"`` (within its part).
        shape: the global shape.
        dtype: e.g. ``"float32"``.
        spec: the ``PartitionSpec`` entries, one per dim (``None``: not split).
        bytes_global: bytes of the whole array.
        bytes_per_device: bytes of one device's shard.
        memory_kind: where the shards live: ``"device"``, or ``"pinned_host"`` for state
            offloaded to host memory (``StepOptions.offload``).
        frozen: a param the optimizer never changes (its update does not depend on the
            gradient: ``optax.set_to_zero()`` for it, :mod:`parallax.state.frozen`).
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: tuple
    bytes_global: int
    bytes_per_device: int
    memory_kind: str = "device"
    frozen: bool = False

    @property
    def sharded(self) -> bool:
        return any(entry is not None for entry in self.spec)


@dataclasses.dataclass(frozen=True)
class Replicated:
    """A large param whole on every device, and why the strategy left it so."""

    path: str
    shape: tuple[int, ...]
    bytes: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path} {self.shape} {format_bytes(self.bytes)}: {self.reason}"


@dataclasses.dataclass(frozen=True)
class Lint:
    """What the sharding leaves on the table.

    Attributes:
        replicated: params of more than ``large_bytes`` whole on every device, largest first.
        unmatched_rules: tensor-parallel name rules in force that match no param.
        sharded_fraction: the fraction of the state's (global) bytes in arrays split over
            some mesh axis.
        large_bytes: the size from which a replicated param is reported.
        frozen: the params the optimizer never changes, by path (marked in the table too).
    """

    replicated: tuple[Replicated, ...]
    unmatched_rules: tuple[str, ...]
    sharded_fraction: float
    large_bytes: int
    frozen: tuple[str, ...] = ()

    def __str__(self) -> str:
        lines = [f"lint: {100 * self.sharded_fraction:.1f}% of state bytes sharded; {len(self.replicated)} param(s) "
                 f"over {format_bytes(self.large_bytes)} replicated on every device"]
        lines += [f"  replicated: {entry}" for entry in self.replicated]
        lines += [f"  rule matches no param: {rule!r}" for rule in self.unmatched_rules]
        if self.frozen:
            lines.append(f"  frozen: {len(self.frozen)} param(s) the optimizer never changes (no gradient reaches "
                         f"their update): {', '.join(self.frozen[:4])}{', ...' if len(self.frozen) > 4 else ''}")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Summary:
    """The table of :func:`summarize`: ``str()`` is plain text, ``print()`` uses rich in a
    terminal, and ``as_dict()`` is for programs.

    Attributes:
        strategy: the strategy, described.
        mesh: mesh axis name to size.
        params: one :class:`LeafRow` per param.
        totals: per part (``params``, ``opt_state``, ``model_state``, ``other``: the step
            counter and rng key, and ``total``): ``count`` (global elements), ``global`` and
            ``per_device`` bytes, and ``host``: of ``per_device``, the bytes each device's shards
            keep in host memory (offloaded state; 0 without offload).
        lint: the :class:`Lint`.
        hosts: over several hosts (processes), which mesh axes stay inside a host and which
            cross them (:func:`parallax.sharding.topology.describe_hosts`); ``None`` on one.
    """

    strategy: str
    mesh: dict[str, int]
    params: tuple[LeafRow, ...]
    totals: dict[str, dict[str, int]]
    lint: Lint
    hosts: str | None = None

    def as_dict(self) -> dict:
        return {"strategy": self.strategy, "mesh": dict(self.mesh), "hosts": self.hosts,
                "params": [dict(dataclasses.asdict(row), spec=list(row.spec), shape=list(row.shape))
                           for row in self.params],
                "totals": {k: dict(v) for k, v in self.totals.items()},
                "lint": {"replicated": [dataclasses.asdict(r) for r in self.lint.replicated],
                         "unmatched_rules": list(self.lint.unmatched_rules),
                         "sharded_fraction": self.lint.sharded_fraction, "large_bytes": self.lint.large_bytes,
                         "frozen": list(self.lint.frozen)}}

    def figure(self, path: str | None = None, budget: int | str | None = None) -> Any:
        """A matplotlib figure of the mesh and of each device's bytes, device and host memory
        apart (:mod:`parallax.state.figure`), saved to ``path`` if given; ``budget`` (bytes or
        ``"16GB"``) draws a line. Needs matplotlib."""
        from parallax.state.figure import draw, summary_bars

        budgets = {str(budget): parse_bytes(budget)} if budget is not None else None
        return draw(summary_bars(self), budgets, "px.summarize", path)

    def _param_cells(self) -> list[tuple[str, ...]]:
        return [(row.path + (" (frozen)" if row.frozen else ""), str(row.shape), row.dtype, _spec_text(row.spec),
                 format_bytes(row.bytes_per_device)) for row in self.params]

    def _total_cells(self) -> list[tuple[str, ...]]:
        host = self.totals["total"]["host"] > 0
        return [(part, f"{t['count']:,}", format_bytes(t["global"]), format_bytes(t["per_device"]),
                 *((format_bytes(t["host"]),) if host else ())) for part, t in self.totals.items()]

    def _total_header(self) -> tuple[str, ...]:
        return ("state", "elements", "global", "per device") + (
            ("of which in host memory",) if self.totals["total"]["host"] else ())

    def __str__(self) -> str:
        out = [f"{self.strategy} on mesh {self.mesh}"] + ([self.hosts] if self.hosts else [])
        out += _columns(("param", "shape", "dtype", "spec", "per device"), self._param_cells())
        out += [""] + _columns(self._total_header(), self._total_cells())
        return "\n".join(out + ["", str(self.lint)])

    def print(self, file: TextIO | None = None) -> None:
        """Prints the summary: a rich table in a terminal, plain text otherwise."""
        file = sys.stdout if file is None else file
        if not getattr(file, "isatty", lambda: False)():
            print(self, file=file)
            return
        from rich.console import Console
        from rich.table import Table

        console = Console(file=file)
        for title, header, cells in ((f"{self.strategy} on mesh {self.mesh}",
                                      ("param", "shape", "dtype", "spec", "per device"), self._param_cells()),
                                     ("state", self._total_header(), self._total_cells())):
            table = Table(title=title)
            for name in header:
                table.add_column(name,
                                 justify="left" if name in ("param", "shape", "dtype", "spec", "state") else "right")
            for row in cells:
                table.add_row(*row)
            console.print(table)
        console.print(str(self.lint), markup=False)


def summarize(plan_or_state: StatePlan | TrainState, strategy: Strategy | None = None, *,
              large_bytes: int = 2**20, fail_if_replicated_over: int | None = None,
              find_frozen: bool = True) -> Summary:
    """Each param's spec and bytes per device, the state's totals, and the sharding lint.

    Args:
        plan_or_state: a :class:`parallax.StatePlan` (``px.plan_state(...)``: nothing is
            allocated) or a built :class:`parallax.TrainState`.
        strategy: the strategy, for the lint's reasons; a plan carries its own.
        large_bytes: params of more bytes than this that stay whole are reported.
        fail_if_replicated_over: raise :class:`ReplicatedParamError` if a param of more
            bytes than this is whole on every device.
        find_frozen: mark the params the optimizer never changes (traces its update: about a
            second for a few hundred params; ``False`` where only the bytes are wanted).

    Returns:
        A :class:`Summary`.
    """
    if isinstance(plan_or_state, StatePlan):
        arrays, strategy, mesh = plan_or_state.abstract_arrays(), plan_or_state.strategy, plan_or_state.mesh
        found = plan_or_state.found  # what the parts found in the traced loss: their reasons read it
    elif isinstance(plan_or_state, TrainState):
        found = NOTHING
        arrays = plan_or_state.replace(params=adapter_for(plan_or_state.model).unbox(plan_or_state.params))
        mesh = next((leaf.sharding.mesh for leaf in jax.tree.leaves(arrays)
                     if isinstance(getattr(leaf, "sharding", None), NamedSharding)), None)
        if mesh is None:
            raise ValueError("The state is not placed on a mesh; build it with px.init_state(...) or pass "
                             "px.plan_state(...).")
    else:
        raise ValueError(f"summarize takes a px.StatePlan (px.plan_state(...)) or a px.TrainState, got "
                         f"{type(plan_or_state).__name__}.")
    rows = {part: _rows(getattr(arrays, part)) for part in PARTS}
    frozen = frozen_paths(arrays.tx, arrays.params, arrays.opt_state) if find_frozen else ()
    rows["params"] = [dataclasses.replace(row, frozen=row.path in frozen) for row in rows["params"]]
    totals = {part: _total(part_rows) for part, part_rows in rows.items()}
    totals["other"] = _total(_rows((arrays.step, arrays.rng)))
    totals["total"] = {k: sum(t[k] for t in totals.values()) for k in ("count", "global", "per_device", "host")}
    all_rows = [row for part_rows in rows.values() for row in part_rows]
    state_bytes = sum(row.bytes_global for row in all_rows)
    sizes = {name: int(size) for name, size in mesh.shape.items()}
    whole = _replicated_params(rows["params"], strategy, sizes, found)
    sharded = sum(row.bytes_global for row in all_rows if row.sharded) / state_bytes if state_bytes else 0.0
    lint = Lint(tuple(r for r in whole if r.bytes > large_bytes),
                _unmatched_rules(strategy, [row.path for row in rows["params"]]), sharded, large_bytes, frozen)
    summary = Summary(strategy.describe(mesh) if strategy is not None else "(strategy not given)", sizes,
                      tuple(rows["params"]), totals, lint, describe_hosts(mesh))
    if fail_if_replicated_over is not None:
        over = [r for r in whole if r.bytes > fail_if_replicated_over]
        if over:
            raise ReplicatedParamError(
                f"{len(over)} param(s) of more than {format_bytes(fail_if_replicated_over)} "
                f"(fail_if_replicated_over={fail_if_replicated_over}) are whole on every device under "
                f"{summary.strategy}:\n  " + "\n  ".join(map(str, over))
                + "\nShard them (FSDP(min_weight_size=...) lower, a mesh size that divides a dim, a tensor-parallel "
                "rule), or raise fail_if_replicated_over.")
    return summary


def _replicated_params(rows, strategy, sizes, found: Found) -> list[Replicated]:
    return sorted((Replicated(row.path, row.shape, row.bytes_global, _why_whole(strategy, row, sizes, found))
                   for row in rows if not row.sharded), key=lambda r: (-r.bytes, r.path))


def _rows(tree: Any) -> list[LeafRow]:
    rows = []
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shape, dtype = tuple(int(d) for d in leaf.shape), leaf.dtype  # a typed PRNG key's dtype too (key<fry>)
        sharding = leaf.sharding
        spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
        rows.append(LeafRow(path_str(key_path), shape, dtype.name, spec, math.prod(shape) * dtype.itemsize,
                            math.prod(sharding.shard_shape(shape)) * dtype.itemsize,
                            getattr(sharding, "memory_kind", None) or "device"))
    return rows


def _total(rows: list[LeafRow]) -> dict[str, int]:
    return {"count": sum(math.prod(row.shape) for row in rows), "global": sum(row.bytes_global for row in rows),
            "per_device": sum(row.bytes_per_device for row in rows),
            "host": sum(row.bytes_per_device for row in rows if row.memory_kind != "device")}


def _why_whole(strategy: Strategy | None, row: LeafRow, sizes: dict[str, int], found: Found) -> str:
    if strategy is None:
        return "(pass the strategy to summarize for the reason)"
    reasons = [part.why_whole(row.path, row.shape, sizes, **found.given(part)) for part in strategy.parts
               if hasattr(part, "why_whole")]
    return "; ".join(reasons) or "no part of the strategy places params"


def _unmatched_rules(strategy: Strategy | None, paths: list[str]) -> tuple[str, ...]:
    if strategy is None:
        return ()
    unmatched = []
    for part in strategy.parts:
        rules = getattr(part, "active_rules", ())
        matched = {tp_rules.match_rule(path, rules) for path in paths} - {None}
        matched_indices = {index for index, _ in matched}
        unmatched += [pattern for index, (pattern, _) in enumerate(rules) if index not in matched_indices]
    return tuple(unmatched)


def _spec_text(spec: tuple) -> str:
    return "(" + ", ".join("-" if entry is None else str(entry) for entry in spec) + ")"


def _columns(header: tuple[str, ...], cells: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(str(c)) for c in column) for column in zip(header, *cells)]
    return ["  " + "  ".join(f"{cell:<{w}}" for cell, w in zip(row, widths)).rstrip() for row in (header, *cells)]
