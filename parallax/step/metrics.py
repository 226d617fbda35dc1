"""Metrics as ``(sum, count)`` pairs, so means stay exact over shards and batches."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

Sums = dict[str, tuple[jax.Array, jax.Array]]


def split_loss_output(output: Any) -> tuple[jax.Array, dict]:
    """Splits a loss function's return value into ``(loss, metrics)``.

    Raises:
        ValueError: the loss is not a scalar, or metrics are not a mapping.
    """
    if isinstance(output, tuple) and len(output) == 2:
        loss, metrics = output
    else:
        loss, metrics = output, {}
    if not hasattr(loss, "shape") or not hasattr(loss, "dtype"):
        raise ValueError(
            f"The loss function returned a loss of type {type(loss).__name__}; return a "
            "scalar array, or (loss, metrics)."
        )
    if loss.shape != ():
        raise ValueError(
            f"The loss function returned a loss of shape {loss.shape}; it must be a scalar "
            "(e.g. take .mean() over the batch)."
        )
    if not jnp.issubdtype(loss.dtype, jnp.floating):
        raise ValueError(f"The loss must be a floating-point scalar, got dtype {loss.dtype}.")
    if metrics is None:
        metrics = {}
    if not isinstance(metrics, Mapping):
        raise ValueError(
            f"The loss function returned metrics of type {type(metrics).__name__}; return "
            "a dict of name -> array."
        )
    if "loss" in metrics:
        raise ValueError("Metrics may not be named 'loss'; the loss is reported under that name already.")
    return loss, dict(metrics)


def to_sums(loss: jax.Array, metrics: Mapping[str, Any], num_examples: int) -> Sums:
    """``(sum, count)`` of the loss and each metric over ``num_examples`` examples.

    A scalar is read as a mean over the examples; an array whose leading dim is the
    batch as per-example values; a ``(sum, count)`` pair is taken as it is.
    """
    sums: Sums = {"loss": (loss.astype(jnp.float32) * num_examples, jnp.asarray(num_examples, jnp.float32))}
    for name, value in metrics.items():
        if isinstance(value, tuple) and len(value) == 2:
            total, count = (jnp.asarray(v, jnp.float32) for v in value)
            if total.shape != () or count.shape != ():
                raise ValueError(f"Metric {name!r} given as (sum, count) must hold two scalars.")
            sums[name] = (total, count)
            continue
        if not hasattr(value, "shape") or not hasattr(value, "dtype"):
            raise ValueError(
                f"Metric {name!r} is a {type(value).__name__}, not an array; return jax "
                "arrays (a scalar mean, per-example values, or a (sum, count) pair)."
            )
        value = jnp.asarray(value, jnp.float32)
        if value.shape == ():
            sums[name] = (value * num_examples, jnp.asarray(num_examples, jnp.float32))
        elif value.shape[0] == num_examples:
            sums[name] = (value.sum(), jnp.asarray(value.size, jnp.float32))
        else:
            raise ValueError(
                f"Metric {name!r} has shape {value.shape}; return a scalar mean, per-example "
                f"values with leading dim {num_examples} (the batch), or a (sum, count) pair."
            )
    return sums


def add_sums(a: Sums, b: Sums) -> Sums:
    """Adds two ``(sum, count)`` dicts with the same names."""
    return {name: (a[name][0] + b[name][0], a[name][1] + b[name][1]) for name in a}


def means(sums: Mapping[str, tuple[Any, Any]]) -> dict[str, Any]:
    """``sum / count`` of each metric."""
    return {name: total / count for name, (total, count) in sums.items()}
