"""``strategies=["auto"]`` in a plan: the meshes ``strategy="auto"`` would price, planned as rows, and the pick.

For each device count, :func:`plan_auto` plans what the Trainer's search prices
(:func:`parallax.parallel.candidates.candidates`: every DP × FSDP × TP mesh, and the pipeline, context
and expert meshes the model calls for, :func:`parallax.parallel.candidates.more_candidates`); each is planned as
a row like any strategy's, and :func:`pick` chooses as the search chooses, without running
anything (the devices are not in hand): the fastest that fits the first memory budget, by the
step's predicted time on the named hardware (``hardware=``), else by the cost model's estimate on
this backend (the row's ``estimate``). The runner-up is shown with its margin.

On a named hardware whose steps are priced from their jaxprs (a GPU or TPU planned without it), the
candidates are bounded before any compiles (:func:`in_bound_order`): each one's step takes at least
its compute and memory terms, read from its jaxpr, to which the compiled program only adds (the
collectives beyond the computation, those on the critical path). They compile in the order of that
bound, and stop where the next bound is no less than the runner-up's predicted step: the pick and its
runner-up are those every candidate compiled would give (the tests check it), for a few compiles where
the layouts' bounds differ (a 70B Llama on 256 H100s: 10 of 70 candidates; see ``pruned``).

Example:
    >>> rows = [{"strategy": "FSDP(fsdp=8)", "error": None, "peak": 5, "collective_bytes": 8, "estimate": 0.2},
    ...         {"strategy": "DataParallel(data=8)", "error": None, "peak": 9, "collective_bytes": 4, "estimate": 0.1}]
    >>> pick(rows, 8, budget=8, hardware=None).describe()
    'auto on 8 devices: FSDP(fsdp=8), est. 200 ms a step (the only one of 2 that fits)'
    >>> pick(rows, 8, budget=None, hardware=None).describe()
    'auto on 8 devices: DataParallel(data=8), est. 100 ms a step; runner-up FSDP(fsdp=8), 2x slower'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from parallax.models.traced import stacked_layers
from parallax.parallel.candidates import candidates, layout_suffix, more_candidates, read_or_none
from parallax.pricing.choice import ranked, runner_up
from parallax.pricing.hardware import Hardware
from parallax.sharding.strategy import Strategy

Rows = Callable[[list[Strategy]], list[dict]]


def plan_auto(device_count: int, rows_for: Rows, model: Any, example_batch: Any, loss_fn: Any,
              rng_streams: Sequence[str], budget: int | None, hardware: Hardware | None,
              bounds_for: Rows | None = None, width: int = 1) -> tuple[list[dict], Pick]:
    """The rows of ``"auto"``'s candidates on ``device_count`` devices (``rows_for`` plans a list of
    strategies), each marked ``auto``, and its :class:`Pick`. As the search: every DP × FSDP × TP
    mesh first, then what the model calls for (its stack of blocks read from its trace, nothing
    allocated), the context meshes among them where none of the first fits ``budget``. With
    ``bounds_for`` (it bounds a list of strategies' steps on ``hardware``, nothing compiled), they
    compile in the order of their bounds, ``width`` at a time (:func:`in_bound_order`)."""

    def planned(pool: list[Strategy], before: list[dict]) -> list[dict]:
        if bounds_for is None or hardware is None:
            return _labelled(rows_for(pool), pool)
        return _labelled(in_bound_order(pool, rows_for, bounds_for, before, budget, width), pool)

    base = candidates(device_count)
    found = planned(base, [])
    over = budget is not None and not any(not row.get("error") and row["peak"] <= budget for row in found)
    stacked = bool(read_or_none("stack of blocks", lambda: stacked_layers(model, example_batch, loss_fn, rng_streams)))
    more = more_candidates(stacked, model, example_batch, loss_fn, rng_streams, device_count, over)
    found += planned(more, found) if more else []
    found = [{**row, "auto": True} for row in found]
    return found, pick(found, device_count, budget, hardware)


def in_bound_order(pool: list[Strategy], rows_for: Rows, bounds_for: Rows, before: list[dict], budget: int | None,
                   width: int = 1) -> list[dict]:
    """The rows of ``pool`` on a named hardware, compiling as few as the pick and its runner-up need.

    Each candidate is bounded first (``bounds_for``: the state planned, the step traced, its
    ``bound`` read from the jaxpr, nothing compiled; one whose state alone exceeds ``budget`` or that
    does not apply stands as that row). Then they compile (``rows_for``) in the order of their
    bounds, ``width`` at a time, until the next bound is no less than the runner-up's predicted step
    among the rows compiled so far and ``before`` (the fastest two that fit ``budget`` and are laid
    out otherwise): no candidate left could be faster than either. Those left are rows with
    ``pruned`` and an ``error`` saying so. A candidate without a bound (priced from its compiled
    program: planned on the hardware itself) always compiles.
    """
    rows = bounds_for(pool)
    bound = {i: row["bound"] for i, row in enumerate(rows) if not row.get("error")}
    queue = sorted(bound, key=lambda i: (bound[i] is not None, bound[i] or 0.0, i))  # unbounded ones first
    while queue:
        limit = _runner_up_seconds([*before, *(row for row in rows if "step" in row)], budget)
        batch = [i for i in queue[:width] if bound[i] is None or bound[i] < limit]
        if not batch:
            break
        for i, row in zip(batch, rows_for([pool[i] for i in batch])):
            rows[i] = row
        queue = [i for i in queue if i not in batch]
    for i in queue:
        rows[i] = {**rows[i], "pruned": True,
                   "error": f"not compiled: its step takes at least {_time(bound[i])} on this "
                   f"hardware (its compute and memory, from its jaxpr), no less than the runner-up's {_time(limit)}"}
    return rows


def _runner_up_seconds(rows: Sequence[dict], budget: int | None) -> float:
    """The predicted step of the second fastest of ``rows`` that fit ``budget``, laid out otherwise than
    the fastest (infinite where there is none)."""
    runner = _best_two(rows, budget, _predicted)[1]
    return float("inf") if runner is None else _predicted(runner)


def _predicted(row: dict) -> float | None:
    """A row's predicted step on the named hardware."""
    return (row.get("step") or {}).get("seconds")


@dataclasses.dataclass(frozen=True)
class _Cost:
    """A row as a pick reads it (:class:`parallax.pricing.choice.Priced`)."""

    seconds: float
    peak: int


def _best_two(rows: Sequence[dict], budget: int | None,
              seconds: Callable[[dict], float | None]) -> tuple[dict | None, dict | None, int]:
    """The pick among ``rows`` (those planned, with ``seconds``) by the search's rule
    (:func:`parallax.pricing.choice.ranked`: the fastest that fits ``budget``), its runner-up laid out otherwise (not
    the same program: the same peak, bytes moved and time, e.g. an FSDP that splits no param beside DP), and how
    many fit. ``None`` for a pick where none fits, for a runner-up where there is none."""
    priced = {str(i): _Cost(seconds(row), row["peak"]) for i, row in enumerate(rows)
              if not row.get("error") and seconds(row) is not None}
    ordered, over, picked = ranked(priced, budget)
    if picked is None or picked in over:
        return None, None, 0
    alike = {i: (rows[int(i)]["peak"], rows[int(i)]["collective_bytes"], cost.seconds) for i, cost in ordered.items()}
    other = runner_up(ordered, picked, over, alike)
    return rows[int(picked)], None if other is None else rows[int(other)], len(ordered) - len(over)


def _labelled(rows: list[dict], strategies: Sequence[Strategy]) -> list[dict]:
    """``rows`` labelled as the search labels its candidates (:func:`parallax.parallel.candidates.layout_suffix`): those
    planned, and those bounded and not compiled."""
    return [row if row.get("error") and not row.get("pruned") else
            {**row, "strategy": row["strategy"] + layout_suffix(strategy)} for row, strategy in zip(rows, strategies)]


@dataclasses.dataclass(frozen=True)
class Pick:
    """What ``"auto"`` picks among a plan's rows on one device count.

    Attributes:
        devices: the device count.
        strategy: the pick's row label (``None`` where no candidate fits the budget).
        seconds: its predicted (``hardware=``) or estimated step time.
        runner_up: the next fastest that fits and is not laid out alike (the same peak, bytes
            moved and time: e.g. an FSDP that splits no param beside DP), and its step time.
        basis: ``"predicted"`` on the named hardware, or ``"est."`` by the cost model here.
        fitting: how many candidates fit, of ``planned`` that apply.
        pruned: of ``planned``, how many were not compiled, their steps' bounds no less than the
            runner-up's (:func:`in_bound_order`).
    """

    devices: int
    strategy: str | None
    seconds: float | None
    runner_up: tuple[str, float] | None
    basis: str
    fitting: int
    planned: int
    pruned: int = 0

    def describe(self) -> str:
        head = f"auto on {self.devices} devices: "
        if self.strategy is None:
            return head + f"none of the {self.planned} candidates that apply fits the memory budget"
        text = head + f"{self.strategy}, {self.basis} {_time(self.seconds)} a step"
        if self.runner_up is None:
            return text + (f" (the only one of {self.planned} that fits)" if self.fitting == 1 < self.planned else "")
        label, seconds = self.runner_up
        text += f"; runner-up {label}, {_margin(seconds, self.seconds)}"
        return text + (f" ({self.pruned} of {self.planned} candidates not compiled: their steps' lower bounds are "
                       "no less)" if self.pruned else "")


def pick(rows: Sequence[dict], devices: int, budget: int | None, hardware: Hardware | None) -> Pick:
    """The fastest of ``rows`` (one device count's ``"auto"`` rows) that fits ``budget`` bytes a device: the
    search's rule (:func:`parallax.pricing.choice.ranked`), on the named hardware's predicted steps or the cost
    model's estimates here."""
    planned = [row for row in rows if not row.get("error") or row.get("over_budget") or row.get("pruned")]

    seconds = _predicted if hardware is not None else lambda row: row.get("estimate")
    basis = "predicted" if hardware is not None else "est."
    best, other, fitting = _best_two(planned, budget, seconds)
    if best is None:
        return Pick(devices, None, None, None, basis, 0, len(planned))
    runner = (other["strategy"], seconds(other)) if other is not None else None
    return Pick(devices, best["strategy"], seconds(best), runner, basis, fitting, len(planned),
                sum(bool(row.get("pruned")) for row in planned))


def _time(seconds: float) -> str:
    return f"{1e3 * seconds:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def _margin(slower: float, faster: float) -> str:
    if faster <= 0:
        return f"{_time(slower)}"
    ratio = slower / faster
    return f"{ratio:.3g}x slower" if ratio >= 1.995 else f"{100 * (ratio - 1):.3g}% slower"
