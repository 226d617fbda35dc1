"""Picking the fastest of compiled candidates by the cost model, within a memory budget.

The candidates are the same work compiled different ways: the compile paths of a step, the
FSDP split of each weight, the mesh shapes of ``strategy="auto"``. Each is compiled ahead of
time (nothing runs), priced by :func:`parallax.pricing.cost.estimate`, and those whose peak
bytes per device exceed the budget are dropped before the fastest is taken.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Protocol

import jax

from parallax import _multihost
from parallax._units import format_bytes, parse_bytes
from parallax.pricing.cost import DeviceSpeeds, Estimate, calibrate, estimate
from parallax.sharding.topology import Topology


@dataclasses.dataclass(frozen=True)
class Choice:
    """What the cost model picked, and why.

    Attributes:
        picked: the label of the candidate taken.
        estimates: every candidate's :class:`Estimate`, by label, fastest first.
        budget: the memory budget in bytes per device (``None``: no limit known).
        over_budget: the labels dropped because their peak exceeds the budget.
        what: what was chosen (``"compile path"``, ``"FSDP"`` (its split), ``"strategy"``).
        timed: the candidates run on the devices to settle a close call (:mod:`parallax.pricing.timing`),
            by label: their median step time in seconds; the pick is then the measured fastest where it
            beats the cost model's pick by more than 10% (:func:`parallax.pricing.timing.measured_pick`).
            Empty when nothing ran.
    """

    picked: str
    estimates: dict[str, Estimate]
    budget: int | None = None
    over_budget: tuple[str, ...] = ()
    what: str = "compile path"
    timed: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def runner_up(self) -> str | None:
        """The fastest candidate after the pick that fits, if any."""
        return runner_up(self.estimates, self.picked, self.over_budget)

    def describe(self) -> str:
        """One line: the pick, its estimate and the runner-up's.

        Example:
            >>> print(step.choice.describe())  # doctest: +SKIP
            compile path jit: est. 61.2 ms (...); runner-up shard_map: est. 190.4 ms (...)
        """
        text = f"{self.what} {self.picked}: est. {self.estimates[self.picked].describe()}"
        if self.runner_up is not None:
            text += f"; runner-up {self.runner_up}: est. {self.estimates[self.runner_up].describe()}"
        if self.over_budget:
            text += f"; over the {format_bytes(self.budget or 0)} budget: {', '.join(self.over_budget)}"
        if self.timed:
            text += "; timed on the devices: " + ", ".join(
                f"{label} {1e3 * seconds:.1f} ms" for label, seconds in sorted(self.timed.items(), key=lambda x: x[1]))
            if self.picked != min(self.timed, key=self.timed.get):
                text += f" ({self.picked} kept: the measured difference is within the timing's noise margin)"
        return text


def device_budget(devices: Sequence[jax.Device]) -> int | None:
    """The memory one device can hold (``bytes_limit``), where the backend reports it (GPU, TPU)."""
    try:
        stats = devices[0].memory_stats() or {}
    except (AttributeError, NotImplementedError, RuntimeError):
        return None
    limit = stats.get("bytes_limit")
    return int(limit) if limit else None


def memory_budget(given: int | str | None, devices: Sequence[jax.Device]) -> int | None:
    """The budget in bytes per device: ``given`` (``"16GB"`` or an int), else the device's own memory."""
    return parse_bytes(given) if given is not None else device_budget(devices)


def choose(compiled: Mapping[str, Any], devices: Sequence[jax.Device], budget: int | None = None, *,
           what: str = "compile path", topology: Topology | None = None, speeds: DeviceSpeeds | None = None) -> Choice:
    """The fastest of ``compiled`` (label -> ``jax.stages.Compiled``) on ``devices`` that fits ``budget``
    (bytes per device, see :func:`memory_budget`; ``None``: no limit).

    ``devices`` are the programs' devices in their order (their mesh's ``devices.flat``): over several
    hosts (the processes, or ``topology``'s as simulated) each collective is priced on the links it
    runs over (:func:`parallax.pricing.cost.estimate`).

    When none fits, the one with the smallest peak is taken (and the choice says every
    candidate was over). ``speeds``: the devices' (a named hardware's, whose devices are not in
    hand); measured on ``devices`` by default (:func:`parallax.pricing.cost.calibrate`).
    """
    speeds = speeds or calibrate(devices)
    estimates = {label: estimate(program, speeds, devices, topology) for label, program in compiled.items()}
    return rank(estimates, budget, what=what)


def rank(estimates: Mapping[str, Estimate], budget: int | None, *, what: str) -> Choice:
    """A :class:`Choice` over already priced candidates (process 0's pick on every process)."""
    if not estimates:
        raise ValueError(f"No candidate {what} to choose from.")
    ordered, over, picked = ranked(estimates, budget)
    return Choice(_multihost.agree(picked), ordered, budget, over, what)


class Priced(Protocol):
    """What a pick reads of a candidate: its step's seconds (estimated or predicted) and its peak bytes a device."""

    @property
    def seconds(self) -> float: ...

    @property
    def peak(self) -> int: ...


def ranked(priced: Mapping[str, Priced], budget: int | None) -> tuple[dict[str, Priced], tuple[str, ...], str | None]:
    """The pick among candidates priced: the one rule of the search (:func:`rank`) and of ``px.plan``'s ``"auto"``
    rows (:func:`parallax.plan.auto.pick`).

    Returns ``priced`` fastest first (ties in the given order), the labels whose peak exceeds ``budget`` bytes a
    device, and the pick: the fastest that fits, else the smallest peak (``None`` where nothing is priced).

    Example:
        >>> from types import SimpleNamespace as Cost
        >>> ordered, over, picked = ranked({"a": Cost(seconds=2.0, peak=5), "b": Cost(seconds=1.0, peak=9),
        ...                                 "c": Cost(seconds=3.0, peak=4)}, budget=8)
        >>> list(ordered), over, picked, runner_up(ordered, picked, over)
        (['b', 'a', 'c'], ('b',), 'a', 'c')
    """
    ordered = dict(sorted(priced.items(), key=lambda item: item[1].seconds))
    over = tuple(label for label, cost in ordered.items() if budget is not None and cost.peak > budget)
    fitting = [label for label in ordered if label not in over]
    picked = fitting[0] if fitting else min(ordered, key=lambda label: ordered[label].peak, default=None)
    return ordered, over, picked


def runner_up(ordered: Mapping[str, Any], picked: str | None, over: Sequence[str],
              alike: Mapping[str, Hashable] | None = None) -> str | None:
    """The fastest of ``ordered`` (fastest first) after ``picked`` that fits (not in ``over``) and, where ``alike``
    gives each label what its program is known by, is not laid out as the pick is."""
    same = (lambda label: alike[label] == alike[picked]) if alike and picked is not None else (lambda label: False)
    return next((label for label in ordered if label != picked and label not in over and not same(label)), None)
