"""Step options: one frozen, validated object shared by the step builders and the Trainer."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from parallax._names import did_you_mean
from parallax._units import parse_bytes
from parallax.models.remat_policy import check_remat, is_policy
from parallax.step.offload import check_offload
from parallax.step.precision_policy import Precision
from parallax.step.precision_policy import resolve as resolve_precision

COMPILE_MODES = ("auto", "shard_map", "jit")
BATCH_STATS_MODES = ("global", "local")


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """How a train or eval step computes; every default is declared here once.

    Attributes:
        compile: ``"auto"`` (exact for any loss: the loss sees the global batch unless it
            is marked :func:`parallax.per_example_loss`, see ``Step.mode()``), ``"jit"``
            (compiler-placed collectives, the loss on the global batch) or ``"shard_map"``
            (explicit collectives; the loss runs on each data shard and the shards' losses
            are averaged: per-shard semantics, exact only for a mean of per-example terms).
        grad_accum: microbatches per step; the update equals one step on the whole batch.
        batch_stats: ``"global"`` (BatchNorm statistics over the whole batch, as on one
            device) or ``"local"`` (each data shard's own; running stats then averaged;
            compiles with ``shard_map``).
        rng_streams: rng names the model draws from (a different stream on each data
            shard, the same on every tensor shard; step ``t`` uses ``fold_in(rng, t)``).
        precision: ``None``/``"fp32"``, or ``"bf16"``: float32 params and optimizer
            state, bfloat16 forward and backward, float32 loss and gradient reductions.
        remat: module classes (or class names) whose activations are recomputed in the
            backward pass instead of stored, e.g. ``("Block",)``; beside them, at most one
            JAX checkpoint policy saying what those calls keep instead of recomputing, e.g.
            ``("Block", jax.checkpoint_policies.dots_saveable)`` (matmul outputs kept,
            elementwise work recomputed) or ``offload_dot_with_no_batch_dims("device",
            "pinned_host")`` (matmul outputs kept in host memory).
        offload: state kept in host memory (``pinned_host``) between steps, sharded as on
            the devices: ``"optimizer"`` (the optimizer state) or ``"optimizer+params"``
            (also the params: the float32 master copy under ``precision="bf16"``). The step
            moves each to the devices where it is used and back, inside the compiled
            program; the update is unchanged (any optax transformation). ``None``: all on
            the devices.
        donate: donate the state's buffers to the train step.
        skip_nonfinite: if the loss or any gradient is NaN/Inf, keep the old params,
            optimizer and model state (the step still counts); metrics gain ``skipped``.
        memory_budget: bytes per device (``"16GB"`` or an int) a compiled step may peak
            at when the cost model picks among candidates (``compile="auto"``); the
            device's own memory where the backend reports it, by default.
        timed_candidates: for ``strategy="auto"``, ``FSDP(split="auto")`` and the train
            step's compile path (``compile="auto"``): how many of the candidates the cost model
            estimates within 25% of its best (all of them, where their steps are so short that
            timing costs under 2 s) are then run for a few steps on the devices (a
            freshly built state, or a copy of the caller's, and the example batch), the measured
            fastest kept (:mod:`parallax.pricing.timing`; cached per machine); for ``"auto"``
            each other layout family's best within 3x is run beside them. ``0`` (or ``1``) keeps
            the cost model's pick and runs nothing.
        search_seconds: for ``strategy="auto"`` and ``FSDP(split="auto")``: the most seconds the
            search spends planning, compiling and timing candidates (simplest meshes first);
            once spent, the candidates not yet tried are skipped (the search's ``skipped`` says
            so) and the best so far is kept. ``None``: no limit. The search also stops once it
            has spent more than the run could save: ``resolve(steps=)`` (the Trainer passes
            ``max_steps``) times the best estimated step time so far, since no plan saves more
            than a whole step. With several processes, process 0's clock decides for all. Where the
            clock cut it short, the same search on the same machine stops there again (cached:
            :mod:`parallax.state.search_budget`), so a rerun trains on the same plan.
        scan_lists: a list of identical blocks the model checkpoints (``nn.remat``, or ``remat=``
            naming their class) and calls in turn runs as one loop over their params stacked,
            as a scanned stack runs (:mod:`parallax.step.list_scan`): the same operations, a
            compile time that does not grow with the depth, and FSDP gathering one block's params
            at a time. The state keeps the model's own tree. Where FSDP splits the params (with
            data and tensor parallelism or without): the loop copies each device's share of the
            blocks' params stacked, which data parallelism alone would copy whole; a pipeline runs
            a list its own way. ``False``: the blocks run unrolled.

    Example:
        >>> StepOptions(grad_accum=2, precision="bf16").grad_accum
        2
        >>> StepOptions(compile="fast")
        Traceback (most recent call last):
        ...
        ValueError: compile='fast'; use one of ('auto', 'shard_map', 'jit').
    """

    compile: str = "auto"
    grad_accum: int = 1
    batch_stats: str = "global"
    rng_streams: tuple[str, ...] = ("dropout",)
    precision: str | Precision | None = None
    remat: tuple = ()
    offload: str | None = None
    donate: bool = True
    skip_nonfinite: bool = False
    memory_budget: int | str | None = None
    timed_candidates: int = 3
    search_seconds: float | None = 120.0
    scan_lists: bool = True

    def __post_init__(self):
        for name in ("rng_streams", "remat"):
            value = getattr(self, name)
            if name == "remat" and is_policy(value):  # a lone policy: check_remat says what it needs
                value = (value,)
            if isinstance(value, (str, type)):
                raise ValueError(f"{name}={value!r}; pass a tuple, e.g. {name}=({value!r},).")
            object.__setattr__(self, name, tuple(value))
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"compile={self.compile!r}; use one of {COMPILE_MODES}.")
        if isinstance(self.grad_accum, bool) or not isinstance(self.grad_accum, int) or self.grad_accum < 1:
            raise ValueError(f"grad_accum={self.grad_accum!r}; use an integer >= 1.")
        if isinstance(self.timed_candidates, bool) or not isinstance(self.timed_candidates, int) \
                or self.timed_candidates < 0:
            raise ValueError(f"timed_candidates={self.timed_candidates!r}; use an integer >= 0 (0: no timing).")
        if self.search_seconds is not None and (isinstance(self.search_seconds, bool) or not isinstance(
                self.search_seconds, (int, float)) or not self.search_seconds > 0):
            raise ValueError(f"search_seconds={self.search_seconds!r}; use a number of seconds > 0, "
                             "or None (no limit).")
        if not isinstance(self.scan_lists, bool):
            raise ValueError(f"scan_lists={self.scan_lists!r}; use True (a list of checkpointed blocks runs as a "
                             "loop) or False (unrolled).")
        if self.batch_stats not in BATCH_STATS_MODES:
            raise ValueError(f"batch_stats={self.batch_stats!r}; use one of {BATCH_STATS_MODES}.")
        if self.batch_stats == "local" and self.compile == "jit":
            raise ValueError("batch_stats='local' needs compile='shard_map' (or 'auto'): under jit the "
                             "compiler computes BatchNorm statistics over the global batch.")
        check_remat(self.remat)
        check_offload(self.offload)
        for stream in self.rng_streams:
            if not isinstance(stream, str):
                raise ValueError(f"rng_streams takes rng names such as 'dropout', got {stream!r}.")
        resolve_precision(self.precision)  # raises for an unknown policy
        if self.memory_budget is not None:
            parse_bytes(self.memory_budget)  # raises for a budget it cannot read

    @property
    def policy(self) -> Precision:
        """The resolved :class:`parallax.step.precision_policy.Precision`."""
        return resolve_precision(self.precision)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The option names."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def create(cls, options: StepOptions | Mapping[str, Any] | None = None, **overrides: Any) -> StepOptions:
        """``options`` (an instance or a mapping) with ``overrides`` applied; unknown names are an error."""
        base = dict(options) if isinstance(options, Mapping) else (
            {name: getattr(options, name) for name in cls.names()} if isinstance(options, StepOptions) else {})
        if options is not None and not isinstance(options, (StepOptions, Mapping)):
            raise ValueError(f"options must be a px.StepOptions, got {options!r:.80}.")
        base.update(overrides)
        unknown = sorted(set(base) - set(cls.names()))
        if unknown:
            raise ValueError(f"Unknown step option(s) {unknown}{did_you_mean(unknown, cls.names())}; the options are "
                             f"{sorted(cls.names())}.")
        return cls(**base)


def memory_fallbacks(options: StepOptions, blocks: Callable[[], Sequence[str]], *,
                     selective: bool = False) -> list[tuple[str, dict[str, Any]]]:
    """The option changes that trade speed for memory where nothing fits, cheapest in speed first: each as it is
    written and as ``StepOptions`` fields. The optimizer state offloaded, the model's repeated blocks rematerialised
    (``blocks()`` is read only where ``options`` leave remat open; with ``selective``, first with the matmuls'
    outputs saved, ``jax.checkpoint_policies.dots_saveable``), the params offloaded too, and both.

    ``strategy="auto"``'s search (:mod:`parallax.state.search`) tries them in this order without the selective
    policy; ``px.plan``'s advice for a budget nothing fits (:mod:`parallax.plan.fixes`) with it.

    Example:
        >>> [text for text, _ in memory_fallbacks(StepOptions(offload="optimizer"), lambda: ("Block",))]
        ["remat=('Block',)", "offload='optimizer+params'", "offload='optimizer+params', remat=('Block',)"]
    """
    tries: list[tuple[str, dict[str, Any]]] = []
    if options.offload is None:
        tries.append(("offload='optimizer'", {"offload": "optimizer"}))
    remat = () if options.remat else tuple(blocks())
    if remat and selective:
        tries.append((_remat_text(remat, "jax.checkpoint_policies.dots_saveable"),
                      {"remat": (*remat, jax.checkpoint_policies.dots_saveable)}))
    if remat:
        tries.append((_remat_text(remat), {"remat": remat}))
    if options.offload != "optimizer+params":
        tries.append(("offload='optimizer+params'", {"offload": "optimizer+params"}))
    if remat:
        tries.append((f"offload='optimizer+params', {_remat_text(remat)}",
                      {"offload": "optimizer+params", "remat": remat}))
    return tries


def _remat_text(targets: Sequence[str], policy: str | None = None) -> str:
    """``remat=('Block',)`` or ``remat=('Block', jax.checkpoint_policies.dots_saveable)``, as written."""
    entries = [repr(target) for target in targets] + ([policy] if policy else [])
    return f"remat=({', '.join(entries)}{',' if len(entries) == 1 else ''})"
