"""``strategies=["auto"]`` in a plan: the meshes ``strategy="auto"`` would price, planned as rows, and the pick.

For each device count, :func:`plan_auto` plans what the Trainer's search prices
(:func:`parallax.sharding.auto.candidates`: every DP × FSDP × TP mesh, and the pipeline, context
and expert meshes the model calls for, :mod:`parallax.state.more_candidates`); each is planned as
a row like any strategy's, and :func:`pick` chooses as the search chooses, without running
anything (the devices are not in hand): the fastest that fits the first memory budget, by the
step's predicted time on the named hardware (``hardware=``), else by the cost model's estimate on
this backend (the row's ``estimate``). The runner-up is shown with its margin.

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
from typing import Any, Callable, Sequence

from parallax.models.traced import stacked_layers
from parallax.pricing.hardware import Hardware
from parallax.sharding.auto import candidates, layout_suffix
from parallax.sharding.strategy import Strategy
from parallax.state.more_candidates import more_candidates, read_or_none


def plan_auto(device_count: int, rows_for: Callable[[list[Strategy]], list[dict]], model: Any, example_batch: Any,
              loss_fn: Any, rng_streams: Sequence[str], budget: int | None,
              hardware: Hardware | None) -> tuple[list[dict], "Pick"]:
    """The rows of ``"auto"``'s candidates on ``device_count`` devices (``rows_for`` plans a list of
    strategies), each marked ``auto``, and its :class:`Pick`. As the search: every DP × FSDP × TP
    mesh first, then what the model calls for (its stack of blocks read from its trace, nothing
    allocated), the context meshes among them where none of the first fits ``budget``."""
    base = candidates(device_count)
    found = _labelled(rows_for(base), base)
    over = budget is not None and not any(not row.get("error") and row["peak"] <= budget for row in found)
    stacked = bool(read_or_none("stack of blocks", lambda: stacked_layers(model, example_batch, loss_fn, rng_streams)))
    more = more_candidates(stacked, model, example_batch, loss_fn, rng_streams, device_count, over)
    found += _labelled(rows_for(more), more) if more else []
    found = [{**row, "auto": True} for row in found]
    return found, pick(found, device_count, budget, hardware)


def _labelled(rows: list[dict], strategies: Sequence[Strategy]) -> list[dict]:
    """``rows`` labelled as the search labels its candidates (:func:`parallax.sharding.auto.layout_suffix`)."""
    return [row if row.get("error") else {**row, "strategy": row["strategy"] + layout_suffix(strategy)}
            for row, strategy in zip(rows, strategies)]


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
    """

    devices: int
    strategy: str | None
    seconds: float | None
    runner_up: tuple[str, float] | None
    basis: str
    fitting: int
    planned: int

    def describe(self) -> str:
        head = f"auto on {self.devices} devices: "
        if self.strategy is None:
            return head + f"none of the {self.planned} candidates that apply fits the memory budget"
        text = head + f"{self.strategy}, {self.basis} {_time(self.seconds)} a step"
        if self.runner_up is None:
            return text + (f" (the only one of {self.planned} that fits)" if self.fitting == 1 < self.planned else "")
        label, seconds = self.runner_up
        return text + f"; runner-up {label}, {_margin(seconds, self.seconds)}"


def pick(rows: Sequence[dict], devices: int, budget: int | None, hardware: Hardware | None) -> Pick:
    """The fastest of ``rows`` (one device count's ``"auto"`` rows) that fits ``budget`` bytes a device."""
    planned = [row for row in rows if not row.get("error") or row.get("over_budget")]  # pruned: they apply

    def seconds(row: dict) -> float | None:
        return (row.get("step") or {}).get("seconds") if hardware is not None else row.get("estimate")

    fitting = sorted((row for row in planned if not row.get("error") and (budget is None or row["peak"] <= budget)
                      and seconds(row) is not None), key=seconds)
    basis = "predicted" if hardware is not None else "est."
    if not fitting:
        return Pick(devices, None, None, None, basis, 0, len(planned))
    best = fitting[0]
    alike = lambda row: (row["peak"], row["collective_bytes"], seconds(row))  # noqa: E731 (the same program)
    others = [row for row in fitting[1:] if alike(row) != alike(best)]
    runner = (others[0]["strategy"], seconds(others[0])) if others else None
    return Pick(devices, best["strategy"], seconds(best), runner, basis, len(fitting), len(planned))


def _time(seconds: float) -> str:
    return f"{1e3 * seconds:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def _margin(slower: float, faster: float) -> str:
    if faster <= 0:
        return f"{_time(slower)}"
    ratio = slower / faster
    return f"{ratio:.3g}x slower" if ratio >= 1.995 else f"{100 * (ratio - 1):.3g}% slower"
