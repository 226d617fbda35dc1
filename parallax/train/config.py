"""The Trainer's options, and what ``fit`` returns."""

from __future__ import annotations

import dataclasses
from typing import Any

from parallax._names import did_you_mean
from parallax.step.mesh_mode import check_sharding_mode
from parallax.step.options import StepOptions
from parallax.train import elastic

# Step options the Trainer sets itself, from its own options.
_TRAINER_OWNED = {"skip_nonfinite": "on_nonfinite='skip'"}


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """Every option of :class:`Trainer`; pass them as keywords or as an ``ml_collections.ConfigDict``.

    The step's options (``grad_accum``, ``precision``, ``remat``, ``compile``,
    ``batch_stats``, ``rng_streams``, ``donate``) are given flat like the others and kept
    in ``step``, a :class:`parallax.StepOptions`; ``config.grad_accum`` reads them too.

    Attributes:
        max_steps: stop after this many updates (counted from the start of the run).
        epochs: stop after this many passes over the data (if ``max_steps`` is unset).
        batch_size: global batch size when the data is given as arrays or as a
            ``grain.MapDataset`` of examples (an iterable's batches must have it, if given).
        eval_batch_size: batch size for array eval data (``batch_size`` by default).
        eval_every: evaluate every this many steps (and at the end).
        checkpoint_dir: where checkpoints go; ``None`` disables them.
        checkpoint_every: save every this many steps (and at the end).
        keep_checkpoints: how many of the newest checkpoints to keep.
        async_checkpoints: write checkpoints in the background.
        seed: seeds init, dropout streams and the data order.
        shuffle: shuffle array data each epoch.
        on_nonfinite: ``"stop"`` (raise :class:`NonFiniteLossError` naming the step) or
            ``"skip"`` (skip that update and go on).
        on_preemption: on SIGTERM or a first SIGINT (Ctrl-C), finish the step, save it
            (whenever the signal arrives), then ``"exit"`` (status 0) or ``"return"`` from
            ``fit``. A second SIGINT stops at once (``KeyboardInterrupt``).
        progress: show a progress bar.
        log_every: refresh the progress bar every this many steps.
        prefetch: batches read and placed on the devices ahead of the step, in a background
            thread (``0``: read in the loop, between steps).
        fetch_every: read metrics back from the device at least every this many steps
            (they are also read whenever a callback or checkpoint needs them). A NaN
            loss is noticed at that read; a checkpoint is only written after its step's
            loss and state were checked.
        summary: print :func:`parallax.summarize` of the planned state at the start of
            ``fit`` (each param's spec and bytes per device, totals, the sharding lint);
            ``None`` (default): when ``progress`` is on.
        fail_if_replicated_over: stop before anything is built if a param of more than
            this many bytes is whole on every device (``px.ReplicatedParamError`` naming it
            and why).
        elastic: how ``fit(resume=True)`` keeps a checkpoint's global batch on another
            number of devices: ``"keep_batch"`` (each data shard takes more or fewer rows;
            the same training for any model) or ``"accumulate"`` (each shard keeps its rows
            per microbatch and ``grad_accum`` is scaled: 8 devices × 1 → 4 devices × 2; the
            same training for a loss that is a mean over examples, while BatchNorm and
            dropout then work per microbatch). A global batch that cannot be kept is an error
            naming the sizes and options; ``batch_size=`` changes it on purpose.
        sharding_mode: how the model runs on the mesh: ``"detect"`` (Auto axes, or Explicit
            ones when JAX refuses the model with Auto axes: a model that calls
            ``jax.sharding.reshard`` or passes ``out_sharding=``), ``"auto"`` or ``"explicit"``
            (see :mod:`parallax.step.mesh_mode`).
        step: the step's options (see :class:`parallax.StepOptions`).

    Example:
        >>> config = TrainerConfig.create({"max_steps": 10, "grad_accum": 2}, batch_size=32)
        >>> config.max_steps, config.batch_size, config.step.grad_accum, config.grad_accum
        (10, 32, 2, 2)
    """

    max_steps: int | None = None
    epochs: int | None = None
    batch_size: int | None = None
    eval_batch_size: int | None = None
    eval_every: int | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    keep_checkpoints: int = 3
    async_checkpoints: bool = True
    seed: int = 0
    shuffle: bool = True
    on_nonfinite: str = "stop"
    on_preemption: str = "exit"
    progress: bool = True
    log_every: int = 10
    fetch_every: int = 32
    prefetch: int = 2
    summary: bool | None = None
    fail_if_replicated_over: int | None = None
    elastic: str = "keep_batch"
    sharding_mode: str = "detect"
    step: StepOptions = StepOptions()

    def __post_init__(self):
        for name in ("log_every", "fetch_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}; use a positive integer.")
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"prefetch={self.prefetch!r}; use the number of batches to place ahead (an int >= 0).")
        for name in ("max_steps", "epochs", "eval_every", "checkpoint_every"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r}; use a positive integer or None.")
        if self.on_nonfinite not in ("stop", "skip"):
            raise ValueError(f"on_nonfinite={self.on_nonfinite!r}; use 'stop' or 'skip'.")
        if self.on_preemption not in ("exit", "return"):
            raise ValueError(f"on_preemption={self.on_preemption!r}; use 'exit' or 'return'.")
        if self.summary not in (None, True, False):
            raise ValueError(f"summary={self.summary!r}; use True, False or None (when progress is on).")
        value = self.fail_if_replicated_over
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"fail_if_replicated_over={value!r}; use a number of bytes (an int >= 0) or None.")
        if self.elastic not in elastic.MODES:
            raise ValueError(f"elastic={self.elastic!r}; use 'keep_batch' (more or fewer rows per data shard) or "
                             "'accumulate' (the same rows per shard, grad_accum scaled).")
        check_sharding_mode(self.sharding_mode)
        if self.checkpoint_every is not None and self.checkpoint_dir is None:
            raise ValueError("checkpoint_every is set but checkpoint_dir is not; say where checkpoints go.")
        if not isinstance(self.step, StepOptions):
            raise ValueError(f"step={self.step!r}; pass a px.StepOptions (or its options flat).")
        if self.step.skip_nonfinite != (self.on_nonfinite == "skip"):
            object.__setattr__(self, "step", dataclasses.replace(self.step, skip_nonfinite=self.on_nonfinite == "skip"))

    def __getattr__(self, name: str) -> Any:
        # Only reached for names that are not fields: the step's options read flat.
        if name in StepOptions.names():
            return getattr(self.step, name)
        raise AttributeError(f"TrainerConfig has no option {name!r}")

    @classmethod
    def create(cls, config: Any = None, **options: Any) -> TrainerConfig:
        """Merges a ConfigDict/dict (first) and keywords (override) into a config."""
        merged: dict[str, Any] = {}
        if config is not None:
            merged.update(config.to_dict() if hasattr(config, "to_dict") else dict(config))
        merged.update(options)
        own = {f.name for f in dataclasses.fields(cls)}
        for name, instead in _TRAINER_OWNED.items():
            if name in merged:
                raise ValueError(f"Trainer sets {name} itself; pass {instead} instead.")
        step_names = set(StepOptions.names())
        unknown = sorted(set(merged) - own - step_names)
        if unknown:
            options = sorted((own | step_names) - {'step'} - set(_TRAINER_OWNED))
            raise ValueError(f"Unknown Trainer option(s) {unknown}{did_you_mean(unknown, options)}; "
                             f"the options are {options}.")
        step = StepOptions.create(merged.pop("step", None),
                                  **{k: merged.pop(k) for k in list(merged) if k in step_names})
        return cls(**merged, step=step)


@dataclasses.dataclass
class History:
    """Metrics of a run: ``train`` (one dict per step) and ``eval`` (one per evaluation)."""

    train: list[dict] = dataclasses.field(default_factory=list)
    eval: list[dict] = dataclasses.field(default_factory=list)


class FitResult(tuple):
    """What ``fit`` returns: the pair ``(state, history)``, and why training stopped.

    Unpacks as ``state, history = trainer.fit(...)``; the fields are also attributes.

    Attributes:
        state: the final :class:`parallax.TrainState`.
        history: the run's :class:`History`.
        stop_reason: ``"max_steps"``, ``"data exhausted"``, ``"preempted"``, or a callback's reason.
    """

    stop_reason: str

    def __new__(cls, state: Any, history: History, stop_reason: str = "") -> FitResult:
        result = super().__new__(cls, (state, history))
        result.stop_reason = stop_reason
        return result

    @property
    def state(self) -> Any:
        return self[0]

    @property
    def history(self) -> History:
        return self[1]

    def __repr__(self) -> str:
        return (f"FitResult(state=<step {getattr(self.state, 'step', '?')}>, history={len(self.history.train)} steps, "
                f"stop_reason={self.stop_reason!r})")
