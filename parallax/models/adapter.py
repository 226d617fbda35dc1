"""The model seam: the one protocol through which the state and step builders use a model.

Everything above this layer (planning the state, the train and eval steps, the Trainer)
talks to a :class:`ModelAdapter`, never to a model library's API. A linen module is adapted
by :class:`parallax.models.linen.LinenModel`; another kind of model is another adapter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

LossFn = Callable[[Any, Any], Any]


@dataclasses.dataclass(frozen=True)
class ParamGather:
    """Params to gather where the model uses them (inside ``shard_map``).

    Attributes:
        specs: the params' ``PartitionSpec`` s, local part (the manual axes only).
        axes: the manual mesh axes whose shards are gathered (the FSDP axes).
    """

    specs: Any
    axes: frozenset[str]


@dataclasses.dataclass(frozen=True)
class ModelRun:
    """How the model runs inside a step.

    Attributes:
        train: the model's other collections (BatchNorm statistics, ...) are updated; in
            evaluation nothing is mutable, as a model called with ``train=False`` expects.
        batch_stats_axes: BatchNorm reduces its statistics over these mesh axes (inside
            ``shard_map``); ``None`` leaves each call with its own batch's statistics.
        remat: module classes (or class names) whose activations are recomputed, and at most
            one JAX checkpoint policy applied to them.
        constraint_axes: the mesh axes the model's own sharding constraints may name.
        compute_dtype: the forward/backward dtype (mixed precision); ``None`` leaves the
            model's own dtypes. Floating outputs are cast back to float32 for the loss.
        gather: FSDP shards to all-gather where each is used (``shard_map`` path).
    """

    train: bool = True
    batch_stats_axes: tuple[str, ...] | None = None
    remat: tuple = ()
    constraint_axes: tuple[str, ...] = ()
    compute_dtype: Any = None
    gather: ParamGather | None = None


class ModelAdapter(Protocol):
    """What parallax needs from a model; one implementation per model library."""

    model: Any

    def init(self, rngs: Mapping[str, Any], batch: Any, loss_fn: LossFn | None,
             constraint_axes: Sequence[str]) -> tuple[Any, dict]:
        """Initial ``(params, model_state)``: params as declared (metadata boxes kept, for
        annotations), the other collections unboxed. Runs under ``jit``/``eval_shape``."""
        ...

    def unbox(self, params: Any) -> Any:
        """Params without metadata boxes: plain arrays, as the state holds them."""
        ...

    def module_calls(self, batch: Any, loss_fn: LossFn | None) -> set[tuple[str, tuple]]:
        """``(class name, path)`` of every module the model runs (traced from shapes, nothing
        allocated): what :func:`parallax.models.blocks.repeated_blocks` reads."""
        ...

    def values(self) -> tuple[Any, dict] | None:
        """``(params, model_state)`` a model already holds (an NNX instance, e.g. pretrained),
        unboxed, to be placed on the mesh as they are; ``None`` when the state is initialised."""
        ...

    def pretrained(self, params: Any) -> Any:
        """Params a user gives to start from, as the state holds them (plain nested arrays):
        e.g. a linen ``{"params": ...}`` variables dict unwrapped, an ``nnx.State`` as a dict."""
        ...

    def bind(self, params: Any, model_state: dict) -> Any:
        """The model holding these values, callable outside a step."""
        ...

    def write_back(self, params: Any, model_state: dict) -> None:
        """Puts trained values into the model object the user passed, where it holds values."""
        ...

    def optimizer(self, optimizer: Any) -> tuple[Any, Any]:
        """``(optax transformation, its state or None)`` from what the user passed as the optimizer
        (an optax transformation, or a model library's optimizer object)."""
        ...

    def apply(self, params: Any, model_state: dict, batch: Any, *, rngs: Mapping[str, Any],
              loss_fn: LossFn | None, run: ModelRun) -> tuple[Any, dict]:
        """``loss_fn(model, batch)`` (or the model on the batch) with these variables:
        ``(output, new_model_state)``."""
        ...
