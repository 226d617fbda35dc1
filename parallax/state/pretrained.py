"""Pretrained params in: checked against the model's shapes, placed on the mesh shard by shard.

Params come as a pytree (host ``numpy`` or device arrays: a Hugging Face Flax model's
``params``, ``nnx.state(model, nnx.Param)``, ...) or as the path of an orbax checkpoint
holding them (the tree itself, or its ``"params"`` entry: a ``StandardCheckpointer`` save of
``{"params": ...}``; a parallax checkpoint directory, whose newest step's params are read, or
one of its steps: a run's params resumed with another optimizer). Either way each
device receives only its own shards: ``jax.device_put`` of a host array to a
``NamedSharding`` sends each device its slice, and orbax reads each shard from disk.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import jax
import numpy as np

from parallax._errors import first_line
from parallax._tree import path_str

log = logging.getLogger("parallax")


def _flat(tree: Any) -> dict[str, Any]:
    return {path_str(key_path): leaf for key_path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def check_params(given: Any, expected: Any, where: str = "the pretrained params") -> None:
    """Raises ``ValueError`` naming the first path where ``given`` differs from ``expected``
    (a missing or extra param, or another shape); dtypes may differ (they are cast).

    Example:
        >>> check_params({"Dense_0": {"kernel": np.zeros((3, 4))}},
        ...              {"Dense_0": {"kernel": jax.ShapeDtypeStruct((4, 4), np.float32)}})
        Traceback (most recent call last):
        ...
        ValueError: The pretrained params do not fit the model: Dense_0/kernel is (3, 4) there but (4, 4) in the model. ...
    """  # noqa: E501 (a doctest's output)
    got, want = _flat(given), _flat(expected)
    problems = []
    for path in sorted(set(got) | set(want)):
        if path not in got:
            problems.append(f"{path} {tuple(want[path].shape)} is in the model but missing there")
        elif path not in want:
            problems.append(f"{path} is there but not in the model")
        elif tuple(np.shape(got[path])) != tuple(want[path].shape):
            problems.append(f"{path} is {tuple(np.shape(got[path]))} there but {tuple(want[path].shape)} in the model")
    if problems:
        more = f" ({len(problems) - 1} more difference(s))" if len(problems) > 1 else ""
        raise ValueError(
            f"{where[0].upper()}{where[1:]} do not fit the model: {problems[0]}{more}. Build the model with the "
            f"config the weights were trained with; for a linen model pass the tree under 'params' (what "
            f"model.init(...)['params'] holds), for an NNX model nnx.state(model, nnx.Param). Model params: "
            f"{', '.join(list(want)[:4])}{', ...' if len(want) > 4 else ''}."
        )


def read_params(path: str | os.PathLike, expected: Any, shardings: Any) -> Any:
    """The params saved in the orbax checkpoint at ``path``, read shard by shard onto ``shardings``.

    Args:
        path: an orbax pytree checkpoint whose tree is the params, or has them under ``"params"``;
            or a parallax checkpoint directory (its newest step) or step folder.
        expected: the model's params as ``ShapeDtypeStruct`` s (checked before anything is read).
        shardings: a ``NamedSharding`` per param.

    Raises:
        ValueError: no checkpoint at ``path``, or params that do not fit the model.
    """
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise ValueError(f"params={path!r}: no such directory; pass an orbax checkpoint folder or a pytree of arrays.")
    path = _params_folder(path)
    checkpointer = ocp.PyTreeCheckpointer()
    try:
        metadata = checkpointer.metadata(path)
    except Exception as err:
        raise ValueError(f"params={path!r} is not an orbax checkpoint ({type(err).__name__}: "
                         f"{first_line(err, 200)}).") from err
    tree = getattr(metadata, "item_metadata", None) or getattr(metadata, "tree", None) or metadata
    tree = dict(tree) if hasattr(tree, "keys") else tree
    nested = isinstance(tree, dict) and "params" in tree and not _fits(tree, expected)
    saved = tree["params"] if nested else tree
    check_params(saved, expected, where=f"the params in {path}" + (" (under 'params')" if nested else ""))
    saved_dtypes = jax.tree.map(  # read as saved, on the model's shardings (cast to its dtypes when built)
        lambda leaf, sharding, meta: jax.ShapeDtypeStruct(leaf.shape, meta.dtype, sharding=sharding),
        expected, shardings, saved)
    item = {"params": saved_dtypes} if nested else saved_dtypes
    restored = checkpointer.restore(path, args=ocp.args.PyTreeRestore(
        item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=nested))
    return restored["params"] if nested else restored


def _params_folder(path: str) -> str:
    """Where the params of ``path`` are: a parallax checkpoint step's ``state`` folder (given the step,
    or the checkpoint directory: its newest step), else ``path`` itself."""
    if os.path.isdir(os.path.join(path, "state")):
        return os.path.join(path, "state")
    steps = sorted(int(name) for name in os.listdir(path)
                   if name.isdigit() and os.path.isdir(os.path.join(path, name, "state")))
    if not steps:
        return path
    log.info("params=%s: the params of its newest checkpoint, step %d.", path, steps[-1])
    return os.path.join(path, str(steps[-1]), "state")


def _fits(tree: Any, expected: Any) -> bool:
    try:
        check_params(tree, expected)
    except ValueError:
        return False
    return True


def _buffers(leaf: Any) -> set[int]:
    try:
        return {shard.data.unsafe_buffer_pointer() for shard in leaf.addressable_shards}
    except Exception:
        return set()


@functools.lru_cache(maxsize=64)
def _copier(shardings: tuple) -> Any:
    """One jitted copy per layout: a search builds each candidate's state from the same values, and a
    new ``jax.jit`` per call would trace and compile the copy again every time."""
    return jax.jit(lambda xs: [x.copy() for x in xs], out_shardings=list(shardings))


def _copies(leaves: list[jax.Array]) -> list[jax.Array]:
    """Each leaf copied into new buffers on its own sharding (memory kind included)."""
    return _copier(tuple(leaf.sharding for leaf in leaves))(leaves)


def put_own(tree: Any, shardings: Any) -> Any:
    """``jax.device_put(tree, shardings)`` in buffers none of ``tree``'s own arrays share: what a
    train state is built from, since its step donates them and the caller's arrays (an NNX module's,
    params passed in) must stay alive.

    ``device_put(..., may_alias=False)`` alone does not ensure that: measured on jax 0.10.2 and 0.12,
    an array on one device put on a sharding that replicates it keeps that device's buffer as its
    first shard, and a step donating the result deletes the caller's array. A leaf that shares a
    buffer so is copied once more on its shards.

    Example:
        >>> mesh = px.DataParallel().make_mesh()
        >>> given = {"w": jnp.ones((4,))}
        >>> placed = put_own(given, {"w": jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())})
        >>> jax.jit(lambda t: t, donate_argnums=0)(placed) and given["w"].is_deleted()
        False
    """
    placed = jax.device_put(tree, shardings, may_alias=False)
    leaves, treedef = jax.tree.flatten(placed)
    sources = jax.tree.leaves(jax.tree.map(lambda leaf, _: leaf, tree, placed))
    shared = [i for i, (source, leaf) in enumerate(zip(sources, leaves, strict=True))
              if isinstance(source, jax.Array) and isinstance(leaf, jax.Array) and _buffers(source) & _buffers(leaf)]
    if shared:
        copies = _copies([leaves[i] for i in shared])
        for i, copy in zip(shared, copies):
            leaves[i] = copy
    return jax.tree.unflatten(treedef, leaves)


def place_params(given: Any, expected: Any, shardings: Any) -> Any:
    """``given`` params (a pytree of arrays, or an orbax checkpoint path) checked against the
    model's (``expected``, ``ShapeDtypeStruct`` s) and put on ``shardings``, one shard per device.

    Example:
        >>> mesh = px.FSDP().make_mesh()
        >>> expected = {"w": jax.ShapeDtypeStruct((8, 2), np.float32)}
        >>> shardings = {"w": jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))}
        >>> placed = place_params({"w": np.ones((8, 2))}, expected, shardings)
        >>> tuple(placed["w"].sharding.spec), placed["w"].addressable_shards[0].data.shape
        (('fsdp',), (1, 2))
    """
    if isinstance(given, (str, os.PathLike)):
        return read_params(given, expected, shardings)
    check_params(given, expected)
    given = jax.tree.map(lambda value, _: value, given, expected)  # the model's tree structure, the given leaves
    return put_own(given, shardings)  # the state's own buffers: a step donating them leaves the caller's arrays alive
