"""A Megatron tensor-parallel layout read from the computation, not from layer names.

The loss is traced once with ``jax.make_jaxpr``. Every dim of every value in the trace is
a node; the ops tie nodes that must be split together:

* elementwise ops, broadcasts, transposes and layout-preserving reshapes tie a dim of
  the result to the dim of each operand it comes from (a ``(B, T, H*D) -> (B, T, H, D)``
  reshape ties ``H*D`` to ``H``: cutting ``H*D`` into equal blocks is cutting ``H``);
* a matmul (``dot_general``) or a convolution ties its operands' contracted dims to
  each other, a batch dim of both operands to the result's, and every other dim of an
  operand to the result's;
* calls into sub-computations (``jit``, ``remat``, ``custom_vjp``, ``scan``, ``while``,
  ``cond``) tie their arguments and results to the inner computation's.

A connected set of tied dims (a *class*) can be split over the tensor axis as a whole:
every array in it then holds ``1/n`` of that dim, and the only communication is where
the class ends. A class ends where it is contracted or reduced (an all-reduce of the
result: the row-parallel end of a Megatron pair) or consumed by an op that needs the whole
dim (an all-gather), and where it begins from a value that needs a gradient (an
all-reduce of that gradient: the column-parallel start). In an MLP ``x -> W1 -> act ->
W2`` the hidden dim is one class holding ``W1``'s output dim and ``W2``'s input dim, so
splitting it is Megatron's column/row pair; attention heads are one class from the
``q``/``k``/``v`` kernels through the batched score and value matmuls to the output
kernel; an embedding table's vocabulary is a class that a lookup ends.

Classes are chosen greedily by param bytes split per byte communicated, skipping a class
that would split a second dim of an array some chosen class already splits, that has a
dim the axis size does not divide, or that holds the batch dim or a scanned layer dim.
The layout is only about speed: whatever is chosen, the compiler inserts the collectives,
so the result is the same as on one device.
"""

from parallax.jaxpr.tp_layout.layout import ParamLayout, TensorLayout, derive_layout
from parallax.jaxpr.tp_layout.walk import expert_dims, scanned_dims

__all__ = ["ParamLayout", "TensorLayout", "derive_layout", "expert_dims", "scanned_dims"]
