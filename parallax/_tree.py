"""Small pytree helpers shared by the spec and step modules."""

from __future__ import annotations

from typing import Any

import jax
from flax.core import meta


def path_str(key_path: tuple) -> str:
    """Renders a jax key path as ``"Block_0/attn/query/kernel"``.

    Example:
        >>> path_str((jax.tree_util.DictKey("Dense_0"), jax.tree_util.DictKey("kernel")))
        'Dense_0/kernel'
    """
    parts = []
    for key in key_path:
        if isinstance(key, jax.tree_util.DictKey):
            parts.append(str(key.key))
        elif isinstance(key, jax.tree_util.GetAttrKey):
            parts.append(key.name)
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, jax.tree_util.FlattenedIndexKey):
            parts.append(str(key.key))
        else:  # pragma: no cover - future key types
            parts.append(str(key))
    return "/".join(parts)


def is_box(x: Any) -> bool:
    """Whether ``x`` is a flax metadata box (``nn.Partitioned`` and friends)."""
    return isinstance(x, meta.AxisMetadata)


def unbox(tree: Any) -> Any:
    """Removes flax metadata boxes without adding sharding constraints."""

    def _unbox(x):
        if isinstance(x, meta.Partitioned):  # includes LogicallyPartitioned
            return x.unbox(apply_constraint=False)
        if is_box(x):
            return x.unbox()
        return x

    return jax.tree.map(_unbox, tree, is_leaf=is_box)
