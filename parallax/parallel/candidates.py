"""The candidate space: what ``strategy="auto"``, ``px.plan(strategies=["auto"])`` and FSDP's split search price.

Every DP × FSDP × TP mesh of the devices (:func:`candidates`), the splits of an FSDP part
(:func:`split_candidates`), and what a model's trace adds once those are priced (:func:`more_candidates`): a
pipeline over the model's stack of blocks, where a priced candidate found one, or over its one repeated block
class kept in a list (:func:`pipeline_candidates`; where the stack's blocks rematerialise themselves, each also
with ``remat="layer"``: fewer FLOPs for more memory, the budget and the prices decide); the sequence split over a
context axis, for a model with attention whose batch the devices do not divide (a few long sequences) or where
no mesh priced so far fits the memory budget (:func:`context_candidates`, the ring method and load balancing
among them); and an expert axis for a model that stacks a mixture of experts' weights, or keeps its experts in a
list (:func:`expert_candidates`). Also the strategy a mesh implies (:func:`from_mesh`).

The search itself (compile each candidate, price it, keep the fastest that fits) is
:mod:`parallax.state.search`; this module only says what the candidates are.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from parallax._errors import first_line
from parallax.models.blocks import listed_experts, module_calls, repeated_blocks
from parallax.models.traced import stack_rematerialises, traced_loss
from parallax.parallel.context.attention import holds_attention
from parallax.parallel.context.part import ContextParallel
from parallax.parallel.experts.dispatch import stacked_experts
from parallax.parallel.experts.part import ExpertParallel
from parallax.parallel.names import parse_strategy
from parallax.parallel.pipeline.part import PipelineParallel
from parallax.sharding.parts import FSDP, FSDP_SPLITS, DataParallel, TensorParallel
from parallax.sharding.strategy import Strategy, combine

AUTO = "auto"


def is_auto(strategy: object) -> bool:
    """Whether ``strategy`` leaves a choice to the cost model: ``"auto"``, or an FSDP part with ``split="auto"``."""
    if isinstance(strategy, str):
        return strategy == AUTO
    return isinstance(strategy, Strategy) and any(isinstance(p, FSDP) and p.split == AUTO for p in strategy.parts)


def check_strategy(strategy: object) -> None:
    """A clear error for anything that is neither a parallax strategy nor ``"auto"``."""
    if isinstance(strategy, Strategy) or strategy == AUTO:
        return
    raise ValueError(f"strategy must be a parallax strategy (e.g. px.FSDP()), a short name (e.g. 'fsdp', "
                     f"'dp2+fsdp') or 'auto', got {strategy!r}.")


def as_strategy(strategy: object) -> Strategy | str:
    """``strategy`` as given, or read from a short name as ``px.plan`` takes it (``"fsdp"``,
    ``"dp2+fsdp"``, ``"fsdp+tp2"``); ``"auto"`` stays; anything else is a clear error.

    Example:
        >>> as_strategy("fsdp+tp2").describe()
        'FSDP(fsdp=-1) × TensorParallel(tensor=2)'
    """
    if isinstance(strategy, str) and strategy != AUTO:
        return parse_strategy(strategy)
    check_strategy(strategy)
    return strategy


def _joined(parts: list[Strategy]) -> Strategy:
    return parts[0] if len(parts) == 1 else combine(*parts)


def candidates(device_count: int, *, data: DataParallel = DataParallel(), fsdp: FSDP = FSDP(split="largest"),
               tensor: TensorParallel = TensorParallel()) -> list[Strategy]:
    """Every DP × FSDP × TP mesh whose sizes multiply to ``device_count`` (an axis of size 1 is
    left out): DP, FSDP, TP, DP×FSDP, DP×TP, FSDP×TP and DP×FSDP×TP. Each part is its template
    (``data``, ``fsdp``, ``tensor``: their other settings, e.g. FSDP's ``min_weight_size``)
    with the size of that mesh. The FSDP template splits each param's largest dim, one
    candidate per mesh; ``fsdp=FSDP(split="auto")`` prices every split on each FSDP mesh too.
    With the default template, FSDP over every device also comes as google-parallax lays it out
    (:func:`every_param`; ``benchmarks/held_out.py``: on a square MLP, 1.24x faster than the
    hybrid ``"auto"`` picked without it).

    Example:
        >>> [s.describe() for s in candidates(4)]  # doctest: +NORMALIZE_WHITESPACE
        ['DataParallel(data=4)', 'FSDP(fsdp=4)', 'TensorParallel(tensor=4)', 'DataParallel(data=2) × FSDP(fsdp=2)',
         'DataParallel(data=2) × TensorParallel(tensor=2)', 'FSDP(fsdp=2) × TensorParallel(tensor=2)',
         'FSDP(fsdp=4)']
        >>> candidates(4)[-1].parts[0].split, candidates(4)[-1].parts[0].min_weight_size
        ('output', 1)
    """
    if isinstance(device_count, bool) or not isinstance(device_count, int) or device_count < 1:
        raise ValueError(f"device_count={device_count!r}; give an int >= 1.")
    divisors = [d for d in range(1, device_count + 1) if device_count % d == 0]
    shapes = [(d, f, device_count // (d * f)) for d, f in itertools.product(divisors, divisors)
              if device_count % (d * f) == 0]
    if device_count == 1:
        return [dataclasses.replace(data, size=1)]
    found = []
    for shape in sorted(shapes, key=lambda s: (sum(x > 1 for x in s), [-x for x in s])):
        parts = [dataclasses.replace(template, size=size) for size, template in zip(shape, (data, fsdp, tensor))
                 if size > 1]
        found.append(_joined(parts))
    default = fsdp == FSDP(split="largest")
    every = every_param(dataclasses.replace(fsdp, size=device_count, split=AUTO)) if default else None
    return found + ([every] if every is not None else [])


def pipeline_candidates(device_count: int, *, data: DataParallel = DataParallel(),
                        fsdp: FSDP = FSDP(split="largest"),
                        pipeline: PipelineParallel = PipelineParallel()) -> list[Strategy]:
    """The meshes with a stage axis ``strategy="auto"`` adds for a model that stacks its blocks:
    for each stage count ``S`` that divides the devices, the pipeline alone (``S`` = all of
    them), or with DP or FSDP over the rest. A stage count the stack's layers do not divide splits
    them unevenly (the first stages one layer more), priced as it runs.

    Example:
        >>> [s.describe() for s in pipeline_candidates(4)]  # doctest: +NORMALIZE_WHITESPACE
        ['PipelineParallel(stage=2) × DataParallel(data=2)', 'PipelineParallel(stage=2) × FSDP(fsdp=2)',
         'PipelineParallel(stage=4)']
    """
    return _each_size_with_the_rest(device_count, lambda stages: dataclasses.replace(pipeline, stages=stages), data,
                                    fsdp)


RING_AXIS = "context_ring"  # the axis of a ring-method context part the search adds
BALANCED_AXIS, RING_BALANCED_AXIS = "context_balanced", "context_ring_balanced"  # the same, load-balanced


def context_candidates(device_count: int, *, data: DataParallel = DataParallel(),
                       fsdp: FSDP = FSDP(split="largest")) -> list[Strategy]:
    """The meshes with a context axis ``strategy="auto"`` adds for a model with attention whose batch
    the devices cannot split (a few long sequences): for each context size ``C`` that divides the
    devices, the sequence over all of them, or DP or FSDP over the rest; and, for models whose
    attention that does not fit, the ``ring`` method (a device holds one block of keys at a time)
    alone or with FSDP over the rest. Then the same meshes with ``load_balance=True`` (the tiles a
    causal mask hides skipped, evenly over the devices: on the causal LM of
    ``benchmarks/context_balance.py`` 0.66-0.84 of the unbalanced step's time and a smaller peak;
    for a mask that hides nothing, only tiles). Each method on its own axis name (``context``,
    ``context_ring``, ``context_balanced``, ``context_ring_balanced``): the mesh of a state the search
    built says which method its steps run (:func:`from_mesh`).

    Example:
        >>> [s.describe() for s in context_candidates(4)]  # doctest: +NORMALIZE_WHITESPACE
        ['ContextParallel(context=2) × DataParallel(data=2)', 'ContextParallel(context=2) × FSDP(fsdp=2)',
         'ContextParallel(context=4)', "ContextParallel(context_ring=2, method='ring') × FSDP(fsdp=2)",
         "ContextParallel(context_ring=4, method='ring')",
         'ContextParallel(context_balanced=2, load_balance=True) × DataParallel(data=2)',
         'ContextParallel(context_balanced=2, load_balance=True) × FSDP(fsdp=2)',
         'ContextParallel(context_balanced=4, load_balance=True)',
         "ContextParallel(context_ring_balanced=2, method='ring', load_balance=True) × FSDP(fsdp=2)",
         "ContextParallel(context_ring_balanced=4, method='ring', load_balance=True)"]
    """
    found = []
    for balanced in (False, True):
        gathered = _each_size_with_the_rest(
            device_count, lambda size, balanced=balanced: _context(size, "all_gather", balanced), data, fsdp)
        ring = _each_size_with_the_rest(
            device_count, lambda size, balanced=balanced: _context(size, "ring", balanced), data, fsdp)
        found += [*gathered, *(s for s in ring if not any(isinstance(part, DataParallel) for part in s.parts))]
    return found


_CONTEXT_AXES = {("all_gather", False): "context", ("ring", False): RING_AXIS, ("all_gather", True): BALANCED_AXIS,
                 ("ring", True): RING_BALANCED_AXIS}


def _context(size: int, method: str = "all_gather", load_balance: bool = False) -> ContextParallel:
    """The context part the search adds, on the axis named for its method."""
    return ContextParallel(size, method=method, axis=_CONTEXT_AXES[method, load_balance], load_balance=load_balance)


def expert_candidates(device_count: int, experts: int, *, data: DataParallel = DataParallel(),
                      fsdp: FSDP = FSDP(split="largest"),
                      expert: ExpertParallel = ExpertParallel()) -> list[Strategy]:
    """The meshes with an expert axis ``strategy="auto"`` adds for a model with ``experts`` experts
    (stacked, or kept in a list: ``expert=ExpertParallel(modules=...)``, the template of the
    part): for each size that divides both the devices and the experts, the experts over all the
    devices, or DP or FSDP over the rest.

    Example:
        >>> [s.describe() for s in expert_candidates(8, experts=4)]  # doctest: +NORMALIZE_WHITESPACE
        ['ExpertParallel(expert=2) × DataParallel(data=4)', 'ExpertParallel(expert=2) × FSDP(fsdp=4)',
         'ExpertParallel(expert=4) × DataParallel(data=2)', 'ExpertParallel(expert=4) × FSDP(fsdp=2)']
        >>> expert_candidates(2, 2, expert=ExpertParallel(modules="Expert"))[0].describe()
        "ExpertParallel(expert=2, modules='Expert')"
    """
    sized = lambda size: dataclasses.replace(expert, size=size)
    return [s for s in _each_size_with_the_rest(device_count, sized, data, fsdp)
            if experts % next(p.size for p in s.parts if isinstance(p, ExpertParallel)) == 0]


def _each_size_with_the_rest(device_count: int, part: Callable[[int], Strategy], data: DataParallel,
                             fsdp: FSDP) -> list[Strategy]:
    """For each size ``S`` > 1 that divides the devices, ``part(S)`` alone (``S`` = all of them), or
    with ``data`` or ``fsdp`` over the rest."""
    found = []
    for size in (d for d in range(2, device_count + 1) if device_count % d == 0):
        rest = device_count // size
        found += [part(size)] if rest == 1 else [combine(part(size), dataclasses.replace(data, size=rest)),
                                                 combine(part(size), dataclasses.replace(fsdp, size=rest))]
    return found


def with_split(strategy: Strategy, split: str) -> Strategy:
    """``strategy`` with each FSDP part's ``split="auto"`` set to ``split``.

    Example:
        >>> with_split(px.combine(px.DataParallel(2), px.FSDP(4, split="auto")), "output").parts[1].split
        'output'
    """
    return _joined([dataclasses.replace(p, split=split) if isinstance(p, FSDP) and p.split == AUTO else p
                    for p in strategy.parts])


def split_candidates(strategy: Strategy) -> list[Strategy]:
    """``strategy`` with each FSDP part's ``split="auto"`` replaced by each concrete split."""
    if not is_auto(strategy):
        return [strategy]
    return [with_split(strategy, split) for split in FSDP_SPLITS if split != AUTO]


def fsdp_split(strategy: Strategy) -> str | None:
    """The split of ``strategy``'s FSDP part (``None`` without one)."""
    return next((p.split for p in strategy.parts if isinstance(p, FSDP)), None)


EVERY_PARAM = ", every param"  # a split label's suffix: the small params split too, as the search adds it
EVERY_PARAM_SIZE = 1  # its min_weight_size: only a scalar stays whole (what a user's 0 does too, labelled as asked)


def split_label(strategy: Strategy) -> str:
    """``split=output``, or ``split=output, every param`` for :func:`every_param`'s layout."""
    part = next((p for p in strategy.parts if isinstance(p, FSDP)), None)
    if part is None:
        return "split=None"
    return f"split={part.split}" + (EVERY_PARAM if part.min_weight_size == EVERY_PARAM_SIZE else "")


def layout_suffix(strategy: Strategy, split_open: bool = False) -> str:
    """What a candidate's label adds to ``strategy.describe()``: its FSDP split where the search left
    it open (``split_open``), and always for :func:`every_param`'s layout, which the description omits.

    Example:
        >>> layout_suffix(every_param(px.FSDP())), layout_suffix(px.FSDP()), layout_suffix(px.FSDP(), True)
        (', split=output, every param', '', ', split=auto')
    """
    split = split_label(strategy)
    return f", {split}" if split_open or EVERY_PARAM in split else ""


def every_param(strategy: Strategy) -> Strategy | None:
    """``strategy`` with each open FSDP split set to ``"output"`` and the small params split too
    (``min_weight_size=1``: all but scalars): google-parallax's layout, where the partitioner
    keeps each weight in place and moves the activations, a bias split like its kernel's output.
    ``None`` where the user chose the threshold (any but the default) or nothing is open.

    Example:
        >>> every_param(px.FSDP()).parts[0].min_weight_size, every_param(px.FSDP(min_weight_size=64))
        (1, None)
    """
    default = FSDP.min_weight_size
    if not any(isinstance(p, FSDP) and p.split == AUTO and p.min_weight_size == default for p in strategy.parts):
        return None
    return _joined([dataclasses.replace(p, split="output", min_weight_size=EVERY_PARAM_SIZE)
                    if isinstance(p, FSDP) and p.split == AUTO else p for p in strategy.parts])


def from_mesh(mesh: Mesh) -> Strategy:
    """The strategy a mesh built by ``strategy="auto"`` stands for (axes ``data``, ``fsdp``, ``tensor``,
    ``context``, ``context_ring``, ``context_balanced``, ``context_ring_balanced``, ``expert``)."""
    contexts = {axis: functools.partial(_context, method=method, load_balance=balanced)
                for (method, balanced), axis in _CONTEXT_AXES.items()}
    kinds = {"data": DataParallel, "fsdp": FSDP, "tensor": TensorParallel, **contexts, "expert": ExpertParallel}
    unknown = [name for name in mesh.axis_names if name not in kinds]
    if unknown:
        raise ValueError(f"strategy='auto' reads the strategy from the state's mesh, but its axes "
                         f"{list(mesh.axis_names)} include {unknown}; pass the strategy the state was built with.")
    return _joined([kinds[name](int(mesh.shape[name])) for name in mesh.axis_names])


def layout_family(strategy: Strategy) -> tuple[str, ...]:
    """A candidate's layout family for timing (:func:`parallax.pricing.timing.closest`): the
    model-parallel parts it combines, by kind; data parallelism and FSDP alone are one family, ``()``.

    Example:
        >>> layout_family(px.combine(px.ExpertParallel(4), px.FSDP(2)))
        ('ExpertParallel',)
    """
    return tuple(sorted({type(part).__name__ for part in strategy.parts if not isinstance(part, (DataParallel, FSDP))}))


log = logging.getLogger("parallax")


def more_candidates(stacked: bool, model: Any, example_batch: Any, loss_fn: Any, rng_streams: Sequence[str],
                    device_count: int, over_budget: bool = False) -> list[Strategy]:
    """The pipelines, context and expert meshes to price besides the DP/FSDP/TP meshes
    (``stacked``: the model stacks its blocks, :func:`stacks`; ``over_budget``: none of those
    meshes fits the memory budget)."""
    more = []
    split_rows = rows(example_batch) % device_count
    traced = traced_loss(model, example_batch, loss_fn, rng_streams).jaxpr if stacked or split_rows or over_budget \
        else None
    calls = read_or_none("modules", lambda: module_calls(model, example_batch, loss_fn))  # read once, for both
    listed = None if calls is None else listed_experts(model, example_batch, loss_fn, calls)
    if stacked:
        more += pipeline_candidates(device_count)
        if stack_rematerialises(traced):  # each block's input kept: one forward fewer, for more memory
            more += pipeline_candidates(device_count, pipeline=PipelineParallel(remat="layer"))
    else:  # one block class kept in a list (not the experts): the pipeline finds it (PipelineParallel's blocks=)
        blocks = () if calls is None else repeated_blocks(model, example_batch, loss_fn, calls)
        if len(blocks) == 1 and (listed is None or blocks[0] != listed[0]):
            more += pipeline_candidates(device_count)
    if (split_rows or over_budget) and holds_attention(traced):
        more += context_candidates(device_count)
    experts = read_or_none("stacked experts", lambda: stacked_experts(model, example_batch, loss_fn, rng_streams)) or 0
    if experts:
        more += expert_candidates(device_count, experts)
    elif listed:
        more += expert_candidates(device_count, listed[1], expert=ExpertParallel(modules=listed[0]))
    return more


def read_or_none(what: str, read: Any) -> Any:
    """What ``read()`` finds in the model, or ``None`` (logged) where it cannot be read: the
    meshes already priced stand without the candidates it would add."""
    try:
        return read()
    except Exception as err:
        log.info("Could not read the model's %s (%s); the candidates they would add are not priced.", what,
                 first_line(err, 200))
        return None


def rows(batch: Any) -> int:
    """The batch's rows (its leaves' leading dim; 0 for a batch without one)."""
    shapes = [tuple(getattr(leaf, "shape", np.shape(leaf))) for leaf in jax.tree.leaves(batch)]
    return next((int(shape[0]) for shape in shapes if shape), 0)


def stacks(plans: Iterable[Any]) -> bool:
    """Whether a priced candidate found a stack of blocks in the model: its FSDP part found the
    param dims a ``scan`` steps over (``plans``: the candidates' state plans)."""
    return any(plan.found.of(part) for plan in plans for part in plan.strategy.parts
               if isinstance(part, (FSDP, ContextParallel)))
