"""A list of blocks' params held stacked, as the state of a pipeline over them keeps them.

A model that keeps its repeated blocks in a list (Hugging Face's Flax GPT-2 and Llama) has one
subtree of params per block: ``h/0/attn/c_attn/kernel``, ``h/1/attn/c_attn/kernel``... A pipeline
runs them on their params stacked by layer, each stage on its own. Held as the model writes
them, every param would be split over the stages along another dim and restacked every step:
each stage receiving the rest of its blocks' bytes, and sending their gradients back, across
whatever link the stage axis spans. :class:`StackedBlocks` holds the list's params stacked
instead (``h/0-3/attn/c_attn/kernel`` of ``[4, ...]``, its layer dim over the stage axis): each
stage's devices hold their own blocks whole, and their optimizer state with them.

It stands in the params tree where the list's parent mapping was, and reads as that mapping
(``params["h"]["2"]`` is block 2's params, sliced out); :func:`unstacked` gives the tree the
model reads, :func:`stacked` the one the state holds.

Example:
    >>> tree = {"h": {"0": {"w": jnp.zeros((2, 3))}, "1": {"w": jnp.ones((2, 3))}}, "head": jnp.zeros(3)}
    >>> held = stacked(tree, [(("h",), ("0", "1"))])
    >>> held["h"], held["h"]["1"]["w"].tolist()
    (StackedBlocks(0-1: 2 blocks), [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    >>> jax.tree.map(jnp.shape, unstacked(held)) == jax.tree.map(jnp.shape, tree)
    True
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from parallax.parallel.pipeline.part import stage_split

Group = tuple[tuple[str, ...], tuple[str, ...]]  # the list's parent path, its blocks' keys in call order


@jax.tree_util.register_pytree_with_keys_class
class StackedBlocks(Mapping):
    """A mapping whose listed blocks' params are held stacked along a new leading dim, in the order
    the model calls them; its other children (a linen module's layers beside its blocks) as they are.

    Args:
        stacked: one block's params tree, each leaf ``[len(keys), ...]``.
        keys: the blocks' keys in the mapping, in call order (``("0", "1", ...)``).
        others: the mapping's other children, by key.
    """

    def __init__(self, stacked: Any, keys: Sequence[str], others: Mapping[str, Any] | None = None):
        self.stacked, self.keys_, self.others = stacked, tuple(keys), dict(others or {})

    @property
    def name(self) -> str:
        """The key its stacked leaves are found under: ``"0-3"``."""
        return f"{self.keys_[0]}-{self.keys_[-1]}"

    def tree_flatten_with_keys(self):
        others = sorted(self.others)
        return (((jax.tree_util.DictKey(self.name), self.stacked),
                 *((jax.tree_util.DictKey(k), self.others[k]) for k in others)), (self.keys_, tuple(others)))

    @classmethod
    def tree_unflatten(cls, aux, children):
        keys, others = aux
        return cls(children[0], keys, dict(zip(others, children[1:])))

    def __getitem__(self, key: str) -> Any:
        if key in self.others:
            return self.others[key]
        if key not in self.keys_:
            raise KeyError(f"{key!r}: the mapping holds {', '.join((*self.keys_, *self.others))}")
        row = self.keys_.index(key)
        return jax.tree.map(lambda leaf: leaf[row], self.stacked)

    def __iter__(self) -> Iterator[str]:
        return iter((*self.keys_, *sorted(self.others)))

    def __len__(self) -> int:
        return len(self.keys_) + len(self.others)

    def __repr__(self) -> str:
        return f"StackedBlocks({self.name}: {len(self.keys_)} blocks" + (
            f"; {', '.join(sorted(self.others))})" if self.others else ")")


def _is_stacked(x: Any) -> bool:
    return isinstance(x, StackedBlocks)


def has_stacked(tree: Any) -> bool:
    """Whether ``tree`` holds any :class:`StackedBlocks`."""
    return any(_is_stacked(x) for x in jax.tree.leaves(tree, is_leaf=_is_stacked))


def subtree(tree: Any, path: Sequence[str]) -> Any:
    """``tree[path[0]][path[1]]...``."""
    for key in path:
        tree = tree[key]
    return tree


def with_subtree(tree: Any, path: Sequence[str], value: Any) -> Any:
    """A copy of ``tree`` with ``value`` at ``path`` (the mappings on the way copied, nothing else)."""
    if not path:
        return value
    copy = dict(tree)
    copy[path[0]] = with_subtree(tree[path[0]], path[1:], value)
    return type(tree)(copy) if not isinstance(tree, dict) else copy


def stacked(tree: Any, groups: Sequence[Group]) -> Any:
    """``tree`` with each group's blocks held stacked, their mapping's other children beside them;
    arrays, or ``ShapeDtypeStruct`` s under ``jax.eval_shape``."""
    for parent, keys in groups:
        blocks = subtree(tree, parent)
        leaves = jax.tree.map(lambda *rows: jnp.stack(rows), *[blocks[k] for k in keys])
        others = {k: v for k, v in blocks.items() if k not in keys}
        tree = with_subtree(tree, parent, StackedBlocks(leaves, keys, others))
    return tree


def unstacked(tree: Any, rows: dict | None = None) -> Any:
    """``tree`` as the model writes it: each :class:`StackedBlocks` back to its blocks (slices of
    its leaves). Where ``rows`` is given, each slice's ``id`` is recorded in it with its stacked
    leaf, row and itself (what :mod:`parallax.parallel.pipeline.stack` runs the pipeline on instead of
    stacking the slices again)."""
    if not has_stacked(tree):
        return tree

    def open_(x: Any) -> Any:
        if not _is_stacked(x):
            return x
        blocks = {}
        for row, key in enumerate(x.keys_):
            def take(leaf: Any, row: int = row) -> Any:
                if isinstance(leaf, jax.ShapeDtypeStruct):  # a restore target: a row split as the model's tree would be
                    return jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype,
                                                sharding=_row_sharding(leaf.sharding, leaf.shape[1:]))
                piece = leaf[row] if isinstance(leaf, np.ndarray) else jax.lax.index_in_dim(leaf, row, keepdims=False)
                if rows is not None:  # the slice itself kept: its id stays its own
                    rows[id(piece)] = (leaf, row, piece)
                return piece
            blocks[key] = jax.tree.map(take, x.stacked)
        return {**blocks, **x.others}

    return jax.tree.map(open_, tree, is_leaf=_is_stacked)


def _row_sharding(sharding: Any, shape: tuple[int, ...]) -> Any:
    """A stacked leaf's sharding for one of its rows (``shape``): its other dims' axes kept, and the
    stage axis of its layer dim placed as on the blocks the model writes
    (:func:`parallax.parallel.pipeline.part.stage_split`)."""
    if not isinstance(sharding, jax.sharding.NamedSharding) or not sharding.spec:
        return sharding
    stage, *rest = (*sharding.spec, *(None,) * (len(shape) + 1 - len(sharding.spec)))
    dims = stage_split(shape, rest, stage, dict(sharding.mesh.shape)) if isinstance(stage, str) else rest
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*dims),
                                      memory_kind=sharding.memory_kind)


def as_written(tree: Any) -> Any:
    """:func:`unstacked` of device arrays as one program, or ``tree`` itself where it holds nothing
    stacked."""
    return jax.jit(unstacked)(tree) if has_stacked(tree) else tree


def stacked_like(tree: Any, like: Any) -> Any:
    """``tree`` (as the model writes its params, or a state holding them so) with its blocks held
    stacked wherever ``like``, a tree of the same values held so, holds them stacked."""
    if not has_stacked(like):
        return tree
    if _is_stacked(like):  # placed as ``like``'s leaves are, where they say
        leaves = jax.tree.map(lambda held, *rows: jnp.stack(rows) if getattr(held, "sharding", None) is None
                              else jax.device_put(jnp.stack(rows), held.sharding),
                              like.stacked, *[tree[k] for k in like.keys_])
        return StackedBlocks(leaves, like.keys_, {k: stacked_like(tree[k], v) for k, v in like.others.items()})
    if isinstance(like, Mapping):
        held = {k: stacked_like(tree[k], like[k]) for k in like}
        return held if isinstance(like, dict) else type(like)(held)
    children, treedef = jax.tree_util.tree_flatten(like, is_leaf=lambda x: x is not like)  # its children, one level
    return jax.tree_util.tree_unflatten(treedef, [stacked_like(t, c) for t, c in zip(
        jax.tree_util.tree_flatten(tree, is_leaf=lambda x: x is not tree)[0], children, strict=True)])


def cast_rows(rows: dict | None, eqn: Any, ins: Sequence[Any], outs: list) -> list:
    """``outs``, and where ``eqn`` casts a row of a stacked leaf (mixed precision's params in
    ``bfloat16``), its output recorded in ``rows`` as that row of the whole leaf cast once."""
    if rows and eqn.primitive.name == "convert_element_type" and id(ins[0]) in rows:
        leaf, row, _ = rows[id(ins[0])]
        key = (id(leaf), str(eqn.params["new_dtype"]))
        if key not in rows:
            rows[key] = jax.lax.convert_element_type(leaf, eqn.params["new_dtype"])
        rows[id(outs[0])] = (rows[key], row, outs[0])
    return outs


def restacked(values: Sequence[Any], rows: Mapping | None) -> Any:
    """``values`` stacked: the stacked leaf itself where they are all its rows in order (slices
    :func:`unstacked` recorded in ``rows``), nothing moved; else ``jnp.stack(values)``."""
    found = [(rows or {}).get(id(value)) for value in values]
    if found and all(f is not None for f in found):
        leaf = found[0][0]
        if all(f[0] is leaf and f[2] is value for f, value in zip(found, values)) \
                and [f[1] for f in found] == list(range(len(values))) and leaf.shape[0] == len(values):
            return leaf
    return jnp.stack(values)


def block_groups(chained: Mapping[str, tuple[int, int]], params: Any) -> list[Group] | str:
    """The lists to hold stacked, from a pipeline's chained params (path → ``(chain, layer)``):
    each chain's blocks, children of one mapping, with the same params; or why not (a sentence)."""
    groups: list[Group] = []
    for chain in sorted({c for c, _ in chained.values()}):
        layers: dict[int, list[str]] = {}
        for path, (c, layer) in chained.items():
            if c == chain:
                layers.setdefault(layer, []).append(path)
        order = sorted(layers)
        split = {layer: sorted(path.split("/") for path in layers[layer]) for layer in order}
        first, second = split[order[0]][0], split[order[-1]][0]
        at = next((d for d, (a, b) in enumerate(zip(first, second)) if a != b), None)  # where the blocks' keys sit
        if at is None:
            return "the blocks' params are not the children of one mapping"
        roots = [tuple(split[layer][0][:at + 1]) for layer in order]
        if any(path[:at + 1] != list(root) or path[at + 1:] != base[at + 1:]
               for layer, root in zip(order, roots)
               for path, base in zip(split[layer], split[order[0]], strict=False)) \
                or any(len(split[layer]) != len(split[order[0]]) for layer in order):
            return "the blocks' params are not the children of one mapping"
        parents = {root[:-1] for root in roots}
        if len(parents) != 1 or any(not root for root in roots):
            return "the blocks' params are not the children of one mapping"
        parent = parents.pop()
        keys = tuple(root[-1] for root in roots)
        try:
            holder = subtree(params, parent)
        except (KeyError, TypeError):
            return "the blocks' params are not the children of one mapping"
        if not isinstance(holder, Mapping) or not set(keys) <= set(holder):
            return "the blocks' params are not the children of one mapping"
        shapes = [jax.tree.map(jnp.shape, holder[k]) for k in keys]
        if any(jax.tree.structure(s) != jax.tree.structure(shapes[0]) or s != shapes[0] for s in shapes[1:]):
            return "the blocks' params differ in shape"
        groups.append((parent, keys))
    return groups
