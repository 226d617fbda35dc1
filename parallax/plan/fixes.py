"""What would make a plan fit a memory budget that none of its candidates fits.

For the candidate with the smallest peak at the largest device count planned, options are
tried in order of what they cost in speed, each by compiling the real train step again
(exact bytes, as for every plan row): the optimizer state in host memory; the model's repeated
blocks (:func:`parallax.models.blocks.repeated_blocks`) rematerialised keeping their matmul outputs, then keeping
nothing; the params in host memory too; that with the blocks rematerialised; then 2x and 4x
the devices, each also with the sequence split over the added devices
(:class:`parallax.ContextParallel`, for a model with attention, its keys and values gathered, then
passed round a ring, the state split over the added devices too where FSDP splits it; each
load-balanced first, ``load_balance=True``, which skips the tiles a causal
mask hides and holds no more, the unbalanced method tried only where the balanced one cannot be
planned): more devices hold a batch of few long sequences only by splitting them. The first that fits
ends the search; every one tried is reported with its numbers; one whose planning subprocess died is
reported so, and the search goes on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from parallax._errors import first_line
from parallax.parallel.context.part import METHODS, ContextParallel
from parallax.sharding.strategy import Strategy, combine
from parallax.step.options import StepOptions, memory_fallbacks


@dataclasses.dataclass(frozen=True)
class Fix:
    """One option tried for a budget nothing fitted.

    Attributes:
        change: what changes, as you would write it: ``offload='optimizer'``, ``remat=('Block',)``,
            ``devices=16``.
        devices: the device count it was planned on.
        row: the plan row it gives (``peak`` in device memory, ``compiled["host"]`` in host memory).
        fits: whether its peak fits the budget.
    """

    change: str
    devices: int
    row: dict
    fits: bool

    def as_dict(self) -> dict:
        return {"change": self.change, "devices": self.devices, "fits": self.fits, "peak": self.row.get("peak"),
                "host": (self.row.get("compiled") or {}).get("host"), "strategy": self.row.get("strategy"),
                "error": self.row.get("error")}


def with_context(strategy: Strategy, size: int, method: str = "all_gather",
                 load_balance: bool = False) -> Strategy | None:
    """``strategy`` with the sequence split over ``size`` more devices (``None`` if it splits it already);
    where it splits the state (FSDP), split over the added devices too (``shard_params=True``), so they
    hold no more of it than the devices before."""
    if any(isinstance(part, ContextParallel) for part in strategy.parts):
        return None
    sharded = any(part.gathers_params for part in strategy.parts)
    return combine(ContextParallel(size, method=method, load_balance=load_balance, shard_params=sharded),
                   *strategy.parts)


def find_fix(evaluate: Callable[..., dict], options: StepOptions, devices: int, budget: int,
             blocks: Sequence[str], more_devices: Sequence[int] = (2, 4), strategy: Strategy | None = None,
             attention: bool = False) -> list[Fix]:
    """Tries the option changes that trade speed for memory
    (:func:`parallax.step.options.memory_fallbacks`, the selective remat policy among them), then more
    devices (each also with the sequence split over the added ones, where the model has attention),
    until one fits ``budget``.

    Args:
        evaluate: ``evaluate(options, devices, strategy=None) -> row`` plans the candidate with those
            options (with ``strategy`` instead of the candidate's where given).
        options: the step options the plan was made with.
        devices: the device count of the candidate.
        budget: bytes per device.
        blocks: module class names ``remat`` may name (:func:`parallax.models.blocks.repeated_blocks`).
        more_devices: factors of ``devices`` to try last, with ``options`` as given.
        strategy: the candidate's strategy (to add a context axis to); ``None``: devices alone.
        attention: the model computes attention (:func:`parallax.parallel.context.attention.model_has_attention`).

    Returns:
        Every option tried, in order; the last fits if any does.
    """
    tried = []
    attempts = [(change, dataclasses.replace(options, **fields), devices, None, False)
                for change, fields in memory_fallbacks(options, lambda: blocks, selective=True)]
    for factor in more_devices:
        attempts.append((f"devices={devices * factor}", options, devices * factor, None, False))
        for method in METHODS if strategy is not None and attention else ():  # gathered, then a block at a time
            for balanced in (True, False):  # the unbalanced method only where the balanced one was not planned
                split = with_context(strategy, factor, method, balanced)
                if split is not None:
                    attempts.append((f"devices={devices * factor}, strategy={split.describe()}", options,
                                     devices * factor, split, not balanced))
    for change, opts, count, other, fallback in attempts:
        if fallback and tried and tried[-1].row.get("error") is None:
            continue
        try:
            row = evaluate(opts, count) if other is None else evaluate(opts, count, other)
        except RuntimeError as err:  # its planning subprocess died (e.g. out of this machine's memory): the
            row = {"error": f"not planned here: {first_line(err)}"}  # plan and the other options kept
        fits = row.get("error") is None and row["peak"] <= budget
        tried.append(Fix(change, count, row, fits))
        if fits:
            break
    return tried
