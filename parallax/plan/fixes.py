"""What would make a plan fit a memory budget that none of its candidates fits.

For the candidate with the smallest peak at the largest device count planned, options are
tried in order of what they cost in speed, each by compiling the real train step again
(exact bytes, as for every plan row): the optimizer state in host memory; the model's repeated
blocks (:func:`repeated_blocks`) rematerialised keeping their matmul outputs, then keeping
nothing; the params in host memory too; that with the blocks rematerialised; then 2x and 4x
the devices. The first that fits ends the search; every one tried is reported with its numbers.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
from flax import nnx

from parallax.models import adapter_for
from parallax.step.options import StepOptions


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


def repeated_blocks(model: Any, example_batch: Any, loss_fn: Any = None) -> tuple[str, ...]:
    """Module classes a model calls at two or more places, that hold modules themselves and are
    not all inside another such class (its repeated blocks): the candidates for ``remat``. A
    linen model is traced from shapes (its calls recorded); an NNX module (or a function that
    builds one, from shapes) is walked.

    Example:
        >>> repeated_blocks(model, batch, loss_fn)  # an MLP: its Dense layers hold no modules
        ()
    """
    calls: set[tuple[str, tuple]] = set()
    if isinstance(model, nn.Module):
        def record(next_fun, args, kwargs, context):
            if context.method_name == "__call__":
                calls.add((type(context.module).__name__, tuple(context.module.path)))
            return next_fun(*args, **kwargs)

        init = lambda key: adapter_for(model).init({"params": key, "dropout": key}, example_batch, loss_fn, ())
        with nn.intercept_methods(record):
            jax.eval_shape(init, jax.random.key(0))
    else:
        module = model if isinstance(model, nnx.Module) else nnx.eval_shape(model) if callable(model) else None
        if module is not None:
            calls = {(type(node).__name__, tuple(path)) for path, node in nnx.iter_graph(module)
                     if isinstance(node, nnx.Module)}
    paths = collections.defaultdict(set)
    for name, path in calls:
        if any(len(other) > len(path) and other[:len(path)] == path for _, other in calls):  # holds modules
            paths[name].add(path)
    repeated = {name: found for name, found in paths.items() if len(found) > 1}
    inside = lambda path, name: any(len(outer) < len(path) and path[:len(outer)] == outer  # noqa: E731
                                    for other, found in repeated.items() if other != name for outer in found)
    return tuple(sorted(name for name, found in repeated.items() if not all(inside(p, name) for p in found)))


def options_to_try(options: StepOptions, blocks: Sequence[str]) -> list[tuple[str, StepOptions]]:
    """The step options to try, cheapest in speed first, each with how it reads."""
    tries: list[tuple[str, dict]] = []
    remat = () if options.remat or not blocks else tuple(blocks)
    if options.offload is None:
        tries.append(("offload='optimizer'", {"offload": "optimizer"}))
    if remat:
        tries.append((_remat_text(remat, "jax.checkpoint_policies.dots_saveable"),
                      {"remat": (*remat, jax.checkpoint_policies.dots_saveable)}))
        tries.append((_remat_text(remat), {"remat": remat}))
    if options.offload != "optimizer+params":
        tries.append(("offload='optimizer+params'", {"offload": "optimizer+params"}))
    if remat:
        tries.append((f"offload='optimizer+params', {_remat_text(remat)}",
                      {"offload": "optimizer+params", "remat": remat}))
    return [(change, dataclasses.replace(options, **fields)) for change, fields in tries]


def _remat_text(targets: Sequence[str], policy: str | None = None) -> str:
    """``remat=('Block',)`` or ``remat=('Block', jax.checkpoint_policies.dots_saveable)``, as written."""
    entries = [repr(target) for target in targets] + ([policy] if policy else [])
    return f"remat=({', '.join(entries)}{',' if len(entries) == 1 else ''})"


def find_fix(evaluate: Callable[[StepOptions, int], dict], options: StepOptions, devices: int, budget: int,
             blocks: Sequence[str], more_devices: Sequence[int] = (2, 4)) -> list[Fix]:
    """Tries :func:`options_to_try`, then more devices, until one fits ``budget``.

    Args:
        evaluate: ``evaluate(options, devices) -> row`` plans the candidate with those options.
        options: the step options the plan was made with.
        devices: the device count of the candidate.
        budget: bytes per device.
        blocks: module class names ``remat`` may name (:func:`repeated_blocks`).
        more_devices: factors of ``devices`` to try last, with ``options`` as given.

    Returns:
        Every option tried, in order; the last fits if any does.
    """
    tried = []
    attempts = [(change, opts, devices) for change, opts in options_to_try(options, blocks)]
    attempts += [(f"devices={devices * factor}", options, devices * factor) for factor in more_devices]
    for change, opts, count in attempts:
        row = evaluate(opts, count)
        fits = row.get("error") is None and row["peak"] <= budget
        tried.append(Fix(change, count, row, fits))
        if fits:
            break
    return tried
