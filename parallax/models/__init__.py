"""Models behind one seam: :func:`adapter_for` gives the :class:`ModelAdapter` of a model.

Above this layer nothing touches a model library's API; a new kind of model (NNX) is a new
adapter here.
"""

from __future__ import annotations

from typing import Any

from parallax.models.adapter import LossFn, ModelAdapter, ModelRun, ParamGather
from parallax.models.linen import LinenModel, is_linen_class, is_linen_model

__all__ = ["LossFn", "ModelAdapter", "ModelRun", "ParamGather", "adapter_for", "check_model"]


def check_model(model: Any) -> None:
    """Raises a clear error, before anything compiles, for a model parallax cannot take yet.

    Raises:
        ValueError: an NNX module (support is coming), a linen module class instead of an
            instance, or anything that is not a flax linen module.
    """
    if is_linen_model(model):
        return
    if is_linen_class(model):
        raise ValueError(f"model is the class {model.__name__}; pass an instance, e.g. {model.__name__}(...).")
    from flax import nnx  # only on this error path

    if isinstance(model, nnx.Module) or (isinstance(model, type) and issubclass(model, nnx.Module)):
        name = model.__name__ if isinstance(model, type) else type(model).__name__
        raise ValueError(
            f"model is a Flax NNX module ({name}); parallax takes flax.linen modules today, and NNX "
            "support (the same strategies and Trainer) is in progress. Meanwhile, wrap it as a linen "
            f"module: flax.nnx.bridge.to_linen({name}, *constructor_args) (without the rngs argument), "
            "and pass that to parallax."
        )
    raise ValueError(
        f"model must be a flax.linen.Module instance, got {type(model).__name__} ({model!r:.80})."
    )


def adapter_for(model: Any) -> ModelAdapter:
    """The :class:`ModelAdapter` of ``model`` (checked with :func:`check_model`)."""
    check_model(model)
    return LinenModel(model)
