"""Context parallelism: a model's sequence split over a mesh axis, its attention included.

A part that changes how the model runs, not only where its arrays live: it places no param unless
told to (``shard_params=True``: split over its axis as FSDP splits them over its own; otherwise
replicated over it, or split by the parts it is combined with), and declares a
:class:`ContextRun` (:attr:`Strategy.run_change`), which the step carries out on the traced loss
(:mod:`parallax.parallel.context.attention`): each attention the model computes is split along its
queries' sequence over the axis, the keys and values gathered whole or passed round the axis a block
at a time (:mod:`parallax.parallel.context.ring`), and everything position-wise around it follows
(the compiler places it).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from parallax.sharding.parts import FSDP, check_axis
from parallax.sharding.specs import entry_size
from parallax.sharding.strategy import Strategy

METHODS = ("all_gather", "ring")


@dataclasses.dataclass(frozen=True)
class ContextRun:
    """How the model's attention runs: its queries' sequence split over ``axis``, by ``method``."""

    axis: str
    method: str = "all_gather"
    load_balance: bool = False


@dataclasses.dataclass(frozen=True)
class ContextParallel(Strategy):
    """The sequence split over ``size`` devices, attention included, for the attention a model already has.

    Every attention in the traced loss (flax's ``nn.MultiHeadDotProductAttention`` and
    ``nnx.MultiHeadAttention``, ``jax.nn.dot_product_attention``, an einsum of ``q`` and ``k``, a
    softmax and an einsum with ``v``, as Hugging Face's Flax models write it) runs with its queries
    split along the sequence over the axis, so the activations around attention are split along the
    sequence too. The model runs on the global sequence: positions, masks and losses mean what they
    mean on one device. Combines with the other parts: ``px.combine(px.ContextParallel(2), px.FSDP(4))``.

    Args:
        size: devices on the axis; ``-1`` takes the devices left over. It must divide the
            sequence length of every attention.
        method: how keys and values reach every query. ``"all_gather"``: each device gathers them
            whole, per attention, and computes its queries' rows of the scores against every key
            (the fewest bytes moved). ``"ring"``: they are passed round the axis a block at a time
            (``ppermute``), each device computing one (its queries × one block of keys) tile of the
            scores at a time, so a device holds ``1/size`` of what ``all_gather`` holds (about half
            the peak at 2,048 tokens, ``benchmarks/context_memory.py``) and moves about twice the
            bytes; for an attention whose weights the model also reads elsewhere it raises, naming
            ``all_gather``. ``strategy="auto"`` and ``px.plan``'s advice price both.
        axis: the mesh axis name.
        load_balance: skip the tiles of the scores the model's mask hides (under a causal mask,
            nearly half), the sequence cut into ``2 × size`` chunks and each device holding an early
            and a late one inside each attention, so every device skips as many; the tiles run one
            at a time, so a device holds one tile of scores, as the ring does
            (:mod:`parallax.parallel.context.balanced`; the model's positions are unchanged; a mask the
            model computes from positions is computed a tile at a time, and a softmax's tile runs 512
            keys a step, so long sequences hold neither the mask nor a tile's scores whole). With
            either method. The sequence length must be a multiple of ``2 × size``; not inside a
            pipeline's stages.
        shard_params: split the params, their gradients and the optimizer state over the axis as
            ``FSDP`` splits them over its own (on the dim another part split, joined to its axis where the
            size allows, else the largest free dim; params over ``min_weight_size``; gathered where a layer
            uses them), so the devices of the context axis
            share the state as FSDP's do (torchtitan's FSDP over its data and context devices):
            ``px.combine(px.ContextParallel(8, shard_params=True), px.FSDP(1))`` holds an eighth of it.
            Otherwise each device of the axis holds the state as the parts it is combined with place it.
        min_weight_size: with ``shard_params``, params with at most this many elements stay whole (FSDP's).

    Example:
        >>> px.ContextParallel(4).describe(), px.ContextParallel(4).model_axes
        ('ContextParallel(context=4)', ('context',))
        >>> px.ContextParallel(4, method="ring").describe()
        "ContextParallel(context=4, method='ring')"
        >>> px.ContextParallel(4, load_balance=True).describe()
        'ContextParallel(context=4, load_balance=True)'
        >>> px.ContextParallel(4, shard_params=True).fsdp_axes
        ('context',)
    """

    size: int = -1
    method: str = "all_gather"
    axis: str = "context"
    load_balance: bool = False
    shard_params: bool = False
    min_weight_size: int = 2**18

    splits_batch = False
    placement_priority = 40  # after FSDP's (20): with shard_params, a dim FSDP left free
    link_rank = 35  # keys and values of every attention, each step: inside a host before data parallelism
    critical_path = True

    def __post_init__(self):
        check_axis("ContextParallel", self.size, self.axis)
        if self.method not in METHODS:
            raise ValueError(f"ContextParallel(method={self.method!r}): use 'all_gather' (each device gathers the "
                             "keys and values of the sequence whole, per attention) or 'ring' (they are passed round "
                             "the axis a block at a time).")
        if not isinstance(self.shard_params, bool):
            raise TypeError(f"ContextParallel(shard_params={self.shard_params!r}): use True (the params, gradients "
                            "and optimizer state split over the context axis, as FSDP splits them) or False.")
        weight = self.min_weight_size
        if isinstance(weight, bool) or not isinstance(weight, int) or weight < 0:
            raise ValueError(f"ContextParallel(min_weight_size={self.min_weight_size!r}): use an integer >= 0 (with "
                             "shard_params=True, the params with at most this many elements stay whole).")
        if not isinstance(self.load_balance, bool):
            raise TypeError(f"ContextParallel(load_balance={self.load_balance!r}): use True (skip the tiles a causal "
                            "mask hides, evenly over the devices) or False.")

    @property
    def described_options(self) -> str:
        return (("" if self.method == "all_gather" else f", method={self.method!r}")
                + (", load_balance=True" if self.load_balance else "")
                + (", shard_params=True" if self.shard_params else ""))

    @property
    def gathers_params(self) -> bool:  # type: ignore[override]
        return self.shard_params

    @property
    def uses_computation(self) -> bool:  # type: ignore[override]  # the scanned layer dims, never split
        return self.shard_params

    def find_in(self, computation: Any) -> dict[str, tuple[int, ...]] | None:
        """With ``shard_params``, the param dims a ``scan`` steps over, as FSDP's :meth:`~parallax.FSDP.find_in`."""
        return self._fsdp().find_in(computation) if self.shard_params else None

    def _fsdp(self) -> FSDP:
        """How its params are split where ``shard_params``: FSDP's rule over this axis."""
        return FSDP(self.size, axis=self.axis, min_weight_size=self.min_weight_size, split="largest")

    @property
    def run_change(self) -> ContextRun:
        return ContextRun(self.axis, self.method, self.load_balance)

    def place(self, path, shape, dims, axis_sizes, found: Mapping[str, tuple[int, ...]] | None = None):
        """With ``shard_params``, a param FSDP split joins the context axis on FSDP's dim where its size
        allows (the state split over the flattened devices, as torchtitan's FSDP over data and context: one
        gather a use); otherwise FSDP's rule over this axis alone."""
        if not self.shard_params or axis_sizes[self.axis] == 1:
            return dims
        fsdp = self._fsdp()
        if math.prod(shape) > self.min_weight_size:
            for d, entry in enumerate(dims):
                axes = entry if isinstance(entry, tuple) else (entry,)
                if entry is not None and d not in (found or {}).get(path, ()) and \
                        shape[d] % (entry_size(entry, axis_sizes) * axis_sizes[self.axis]) == 0:
                    return [*dims[:d], (*axes, self.axis), *dims[d + 1:]]
        return fsdp.place(path, shape, dims, axis_sizes, found)

    def why_whole(self, path, shape, axis_sizes, found: Mapping[str, tuple[int, ...]] | None = None) -> str:
        """Why this part leaves a param whole (a line for ``px.summarize``'s lint)."""
        if self.shard_params:
            return self._fsdp().why_whole(path, shape, axis_sizes, found)
        return f"ContextParallel({self.axis}) splits the sequence, not params (shard_params=True splits them too)"
