"""Models behind one seam: :func:`adapter_for` gives the :class:`ModelAdapter` of a model.

Above this layer nothing touches a model library's API; a new kind of model (NNX) is a new
adapter here.
"""

from __future__ import annotations

import sys
from typing import Any

from parallax.models.adapter import LossFn, ModelAdapter, ModelRun, ParamGather
from parallax.models.linen import LinenModel, is_linen_class, is_linen_model

__all__ = ["LossFn", "ModelAdapter", "ModelRun", "ParamGather", "adapter_for", "check_model", "unwrap_pretrained"]


def unwrap_pretrained(model: Any, params: Any = None) -> tuple[Any, Any]:
    """``(model, params)`` with a Hugging Face Flax model object (``FlaxGPT2LMHeadModel(config)``,
    ``FlaxOPTForCausalLM.from_pretrained(...)``) taken as it is: its flax module, and its params as
    the start unless ``params=`` gives others. Anything else is returned as given.

    Raises:
        ValueError: such an object built without params (``_do_init=False``) and no ``params=``.
    """
    if not any(cls.__name__ == "FlaxPreTrainedModel" for cls in type(model).__mro__):
        return model, params
    if params is None:
        try:
            params = model.params
        except ValueError:  # transformers: "`params` cannot be accessed ... created with `_do_init=False`"
            params = None
        if params is None:
            raise ValueError(f"{type(model).__name__} was loaded without its params (_do_init=False); pass them: "
                             "params=the params from_pretrained returned with it.")
    return model.module, params


def _nnx_module_types() -> tuple[type, ...]:
    """``(nnx.Module, nnx.graph.GraphDef)`` where the program has imported ``flax.nnx``, else ``()``:
    an NNX module exists only once ``flax.nnx`` is imported, so a linen user's ``import parallax``
    does not import it (0.24 s of the 3 s it took)."""
    nnx = sys.modules.get("flax.nnx")
    return () if nnx is None else (nnx.Module, nnx.graph.GraphDef)


def is_nnx_model(model: Any) -> bool:
    """Whether ``model`` is an NNX module instance, or its graph definition."""
    return isinstance(model, _nnx_module_types())


def is_nnx_class(model: Any) -> bool:
    """Whether ``model`` is an NNX module class (not an instance)."""
    types = _nnx_module_types()
    return bool(types) and isinstance(model, type) and issubclass(model, types[0])


def check_model(model: Any) -> None:
    """Raises a clear error, before anything compiles, for a model parallax cannot take.

    Takes a linen module instance, an NNX module instance, or a function that builds an NNX
    module (then planned from shapes, never whole on one device).

    Raises:
        ValueError: a linen or NNX module class instead of an instance, or anything else.
    """
    if is_linen_model(model) or is_nnx_model(model):
        return
    if is_linen_class(model):
        raise ValueError(f"model is the class {model.__name__}; pass an instance, e.g. {model.__name__}(...).")
    if is_nnx_class(model):
        raise ValueError(f"model is the NNX class {model.__name__}; pass an instance, e.g. "
                         f"{model.__name__}(..., rngs=nnx.Rngs(0)), or a function that builds one.")
    if callable(model):
        return  # a function that builds an NNX module: checked when it is traced (NNXModel.of)
    raise ValueError(
        f"model must be a flax.linen.Module or flax.nnx.Module instance (or a function that builds an NNX "
        f"module), got {type(model).__name__} ({model!r:.80})."
    )


def adapter_for(model: Any) -> ModelAdapter:
    """The :class:`ModelAdapter` of ``model`` (checked with :func:`check_model`)."""
    check_model(model)
    if is_linen_model(model):
        return LinenModel(model)
    from parallax.models.nnx import NNXModel  # imports flax.nnx: an NNX model, or a function that builds one

    return NNXModel.of(model)
