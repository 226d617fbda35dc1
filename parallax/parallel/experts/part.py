"""Expert parallelism: a mixture of experts' stacked weights split over a mesh axis by expert.

A part that places the experts dim of every param that stacks a mixture of experts' weights
(``[experts, d_model, d_ff]``) over its axis, found from the traced loss
(:func:`parallax.jaxpr.tp_layout.expert_dims`: a param dim that a matmul batches over together
with activations, and the same dim of the stacked params tied to it) or named by rules, and
splits the batch over the same axis for the layers outside the experts, as data parallelism does.
Each device then holds ``1/size`` of the experts, and computes only its experts' tokens: the part
declares an :class:`ExpertRun` (:attr:`Strategy.run_change`), which the step carries out on the
traced loss (:mod:`parallax.parallel.experts.dispatch`), pinning each matmul over the experts' weights
along the experts dim so that the tokens move to the experts rather than the experts to the tokens.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from parallax.sharding.parts import check_axis, check_module_class
from parallax.sharding.strategy import Strategy


def ruled_dims(paths: Sequence[str], rules: Sequence[tuple[str, int]]) -> dict[str, int]:
    """The experts dim ``rules`` name for each of ``paths`` that one matches (the first match wins).

    Example:
        >>> ruled_dims(["moe/w_in", "head/kernel"], [(r"w_in|w_out", 0)])
        {'moe/w_in': 0}
    """
    found = {}
    for path in paths:
        dim = next((dim for regex, dim in rules if re.search(regex, path)), None)
        if dim is not None:
            found[path] = dim
    return found


class NoExpertsError(ValueError):
    """An :class:`ExpertParallel` found no experts to split (the planner adds which module classes
    the model calls side by side, as ``modules=`` names them)."""


@dataclasses.dataclass(frozen=True)
class ExpertRun:
    """How the model's experts run: each matmul over their stacked weights (found in the traced
    loss, or named by ``rules``) split along the experts dim over ``axis``."""

    axis: str
    rules: tuple = ()
    modules: str | type | None = None  # the class of experts kept in a list, each call run as one of a batch


@dataclasses.dataclass(frozen=True)
class FoundExperts:
    """What :class:`ExpertParallel` finds in the traced loss (:meth:`ExpertParallel.find_in`).

    Attributes:
        experts: the experts dim of each stacked param, by path.
        listed: with ``modules=``, the listed experts' params, by path (each split along its largest dim the axis
            divides).
    """

    experts: Mapping[str, int] = dataclasses.field(default_factory=dict)
    listed: Mapping[str, None] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ExpertParallel(Strategy):
    """A mixture of experts' stacked weights split over ``size`` devices by expert; the batch too.

    Args:
        size: devices on the axis; ``-1`` takes the devices left over. It must divide the number
            of experts.
        axis: the mesh axis name.
        rules: ``(regex, dim)`` pairs naming the experts dim of params whose path matches (first
            match wins), for stacked experts the traced loss does not show (none is needed for
            weights a matmul batches over with the dispatched tokens).
        modules: the class (or class name) of a model's experts kept as a list of separate
            modules, e.g. ``"ExpertFFN"``; ``None``: the model stacks its experts. Each listed
            expert's params are split along their largest dim the axis divides (``1/size`` of the
            experts' bytes per device, as with stacked experts); the step stacks them by expert
            (an all-to-all per weight), runs the experts as one batch split by expert over the
            axis, and hands each call its own result.

    Example:
        >>> px.ExpertParallel(8).describe(), tuple(px.ExpertParallel(8).batch_spec())
        ('ExpertParallel(expert=8)', ('expert',))
    """

    size: int = -1
    axis: str = "expert"
    rules: Sequence[tuple[str, int]] = ()
    modules: str | type | None = None

    splits_batch = True  # the layers outside the experts run data-parallel over the axis
    gathers_params = False
    placement_priority = 5  # the experts dim first: the other parts split the dims left
    link_rank = 15  # tokens to their experts and back at every MoE layer: inside a host, after TP
    critical_path = True
    uses_computation = True

    def __post_init__(self):
        check_axis("ExpertParallel", self.size, self.axis)
        for rule in self.rules:
            if not (isinstance(rule, tuple) and len(rule) == 2 and isinstance(rule[0], str)
                    and isinstance(rule[1], int)):
                raise ValueError(f"ExpertParallel(rules=...): {rule!r} is not a (regex, dim) pair, e.g. "
                                 "(r'moe/w_(in|out)', 0).")
        check_module_class("ExpertParallel", "modules", self.modules, "the experts'", "ExpertFFN")

    def find_in(self, computation: Any) -> FoundExperts:
        """The stacked experts found in the traced loss (and named by its rules), or with ``modules=`` the listed
        experts' params.

        Raises:
            NoExpertsError: the model has no experts this part can split (the message says what it has).
        """
        found = {**computation.expert_dims(), **ruled_dims(computation.param_paths, self.rules)}
        if self.modules is not None:
            siblings = computation.sibling_params()
            listed = {path: None for path in siblings if path not in found}
            size, name = computation.axis_sizes.get(self.axis, 1), getattr(self.modules, "__name__", self.modules)
            counts: dict[int, int] = {}  # experts per group: its last member's place + 1
            for group, member in siblings.values():
                counts[group] = max(counts.get(group, 0), member + 1)
            uneven = next(((group, count) for group, count in counts.items() if count % size), None)
            if uneven:
                group, count = uneven
                example = next(path for path, (g, _) in siblings.items() if g == group)
                raise ValueError(f"ExpertParallel({self.axis}={size}, modules={name!r}): the "
                                 f"model calls {count} experts side by side ({example}, ...), which {size} devices do "
                                 f"not divide: use a size that divides {count}.")
            if not listed:
                raise NoExpertsError(
                    f"ExpertParallel(modules={name!r}) found no experts of that class called side by side in the "
                    f"model: no two calls of {name} that compute the same thing on their own params, neither reading "
                    "the other's result. Name the class of one expert of the list, or leave modules=None for a model "
                    "that stacks its experts.")
            return FoundExperts(found, listed)
        if not found:
            named = list(dict.fromkeys(match.group(0) for path in computation.param_paths
                                       if (match := re.match(r"(?i).*?expert[^/]*", path))))
            listed = (f" It has {len(named)} modules named like experts, each with its own params "
                      f"({', '.join(named[:4])}{', ...' if len(named) > 4 else ''}): a list of experts, which no "
                      "axis can split by expert.") if named else ""
            raise NoExpertsError(
                "ExpertParallel found no stacked experts in the model: no param has a dim that a matmul batches over "
                "together with the tokens (einsum('ecd,edh->ech', dispatched, w_in) with w_in of shape "
                "[experts, d, h])."
                f"{listed} Name the class of one listed expert (ExpertParallel(modules=...)), stack the "
                "experts' weights in one param per weight, experts first (nn.vmap / nnx.vmap over the expert "
                "modules, or one [experts, ...] param), or name the experts dim: "
                "ExpertParallel(rules=((r'w_in|w_out', 0),)).")
        return FoundExperts(found)

    @property
    def described_options(self) -> str:
        return "" if self.modules is None else f", modules={getattr(self.modules, '__name__', self.modules)!r}"

    @property
    def run_change(self) -> ExpertRun:
        return ExpertRun(self.axis, tuple(self.rules), self.modules)

    def place(self, path, shape, dims, axis_sizes, found: FoundExperts | None = None):
        """``dims`` with this axis on a stacked param's experts dim, or on a listed expert's largest dim the axis
        divides (``found``: :meth:`find_in`'s)."""
        found = found or FoundExperts()
        dim, size = found.experts.get(path), axis_sizes[self.axis]
        if path in found.listed and size > 1:  # a listed expert's param: its largest dim the axis divides
            free = [d for d in range(len(shape)) if dims[d] is None and shape[d] % size == 0]
            if not free:
                return dims
            dim = max(free, key=lambda d: (shape[d], -d))
            return [*dims[:dim], self.axis, *dims[dim + 1:]]
        if dim is None or size == 1 or dims[dim] is not None:
            return dims
        if shape[dim] % size:
            raise ValueError(f"ExpertParallel({self.axis}={size}): {path} stacks {shape[dim]} experts (dim {dim} of "
                             f"{tuple(shape)}), which {size} devices do not divide: use a size that divides "
                             f"{shape[dim]}.")
        return [*dims[:dim], self.axis, *dims[dim + 1:]]

    def why_whole(self, path, shape, axis_sizes, found: FoundExperts | None = None) -> str:
        """Why this part leaves a param whole (a line for ``px.summarize``'s lint)."""
        if found is not None and path in found.listed:
            return (f"ExpertParallel({self.axis}) splits a listed expert's param along a dim that "
                    f"{axis_sizes[self.axis]} divides (it has none)")
        return f"ExpertParallel({self.axis}) splits only the experts' params"
