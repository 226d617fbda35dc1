"""Saying that a loss is a mean of per-example terms, so each data shard may compute its own.

parallax's default is exact for any loss: ``compile="auto"`` runs the loss on the global
batch (``jit`` with shardings) unless the loss is a mean of per-example terms, which it reads
from the loss's trace (:mod:`parallax.jaxpr.per_example`) or from this mark. A loss
normalised by a batch-wide count (masked LM: ``sum(token_losses) / num_masked``), one that
reads batch-wide statistics (an MoE load-balancing term) or one that compares examples with
each other (in-batch negatives, CLIP/SimCLR) is *not* a mean of per-example terms: computed
per shard and averaged it is a different objective, silently.

Mark a loss only where the trace cannot prove what you know, e.g. a model with dropout
whose per-shard masks you accept. A marked loss may take the explicit ``shard_map`` path
(each device runs the loss on its slice; losses and metrics are averaged over the shards).
Marking a loss that is not per-example trains a different objective, exactly as
``compile="shard_map"`` does: that is the documented per-shard semantics.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class PerExampleLoss:
    """A loss function marked as a mean (over the batch) of per-example terms.

    Calls through to ``fn``; parallax reads the mark when it chooses how to compile.

    Attributes:
        fn: the loss function, ``fn(model, batch) -> loss`` or ``(loss, metrics)``.
    """

    fn: Callable[..., Any]

    def __post_init__(self):
        if not callable(self.fn):
            raise ValueError(f"per_example_loss takes a loss function, got {self.fn!r}.")

    def __call__(self, model: Any, batch: Any) -> Any:
        return self.fn(model, batch)


def per_example_loss(fn: Callable[..., Any]) -> PerExampleLoss:
    """Marks ``fn`` as a mean of per-example terms (every metric too): shards may compute it alone.

    Use it as a decorator. Then ``compile="auto"`` may run the loss per data shard (the
    ``shard_map`` path) where that is faster. Without the mark the same holds where the
    loss's trace proves it a mean of per-example terms; otherwise the loss sees the whole
    global batch, which is exact for any loss.

    Example:
        >>> import optax, parallax as px
        >>> @px.per_example_loss
        ... def loss_fn(model, batch):
        ...     logits = model(batch["x"])
        ...     return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        >>> px.is_per_example_loss(loss_fn)
        True
    """
    return fn if isinstance(fn, PerExampleLoss) else PerExampleLoss(fn)


def is_per_example_loss(fn: Any) -> bool:
    """Whether ``fn`` was marked with :func:`per_example_loss`."""
    return isinstance(fn, PerExampleLoss)
