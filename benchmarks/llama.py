"""Llama 3.1–shaped transformers written as users write them, for planning at scale without the model.

Two ways users write the same model in Flax linen: a scanned stack (``nn.scan`` over one block, as
MaxText does) and a Hugging Face–style list of blocks (``FlaxLlamaModel``'s ``layers_{i}``).
Grouped-query attention, SwiGLU, RMSNorm, bf16 compute over float32 params, untied head. Shapes
from Meta's Llama 3.1 configs (``SHAPES``); nothing here allocates them: ``px.plan`` plans from
shapes (``batch(...)`` returns ``jax.ShapeDtypeStruct`` s).

Example:
    >>> model = Llama(SHAPES["8b"]._replace(layers=2, dim=64, ffn=128, heads=4, kv_heads=2, vocab=256))
    >>> tokens = jnp.zeros((2, 9), jnp.int32)
    >>> jax.eval_shape(lambda: model.init(jax.random.key(0), tokens[:, :-1]))["params"]["head"]["kernel"].shape
    (64, 256)
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


class Shape(NamedTuple):
    layers: int
    dim: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int = 128_256
    chunk: int = 0  # attention over query chunks of this many tokens (memory-efficient, as flash attention); 0: whole
    flash: str = ""  # attention by jax's Pallas flash-attention kernel for "gpu" or "tpu" (flash_attention); over chunk
    saved: tuple = ()  # what each remat'd block keeps for its backward, by name (TORCHTITAN_SELECTIVE...);
    # () recomputes all
    offloaded: bool = False  # the saved values kept in the host's memory (as MaxText offloads them), not the device's
    dtype: str = "bfloat16"  # the compute dtype (params stay float32); "float32" for runs on a CPU


SHAPES = {  # Llama 3.1 (Meta's model cards / configs)
    "8b": Shape(layers=32, dim=4096, ffn=14_336, heads=32, kv_heads=8),
    "70b": Shape(layers=80, dim=8192, ffn=28_672, heads=64, kv_heads=8),
    "405b": Shape(layers=126, dim=16_384, ffn=53_248, heads=128, kv_heads=8),
}


class RMSNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-5)
        return (normed * scale).astype(x.dtype)


def chunked_attention(q: jax.Array, k: jax.Array, v: jax.Array, chunk: int) -> jax.Array:
    """Causal attention one chunk of queries at a time, each chunk rematerialised: the scores held are
    ``chunk × sequence`` a head, not ``sequence²`` (Rabe & Staats' memory-efficient attention, what a
    flash-attention kernel holds at most, as plain JAX a planner can compile on any backend). The same
    FLOPs as the whole attention (masked tiles are computed, as XLA's attention computes them).

    Example:
        >>> q = k = v = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))
        >>> mask = nn.make_causal_mask(jnp.ones((1, 8)))
        >>> bool(jnp.allclose(chunked_attention(q, k, v, 4), nn.dot_product_attention(q, k, v, mask=mask), atol=1e-6))
        True
    """
    b, n, h, d = q.shape
    if n % chunk:
        raise ValueError(f"chunk={chunk} must divide the sequence of {n} tokens.")
    keys = jnp.arange(n)

    @jax.checkpoint
    def one(args):
        queries, start = args
        scores = jnp.einsum("bqhd,bkhd->bhqk", queries, k).astype(jnp.float32) / jnp.sqrt(d).astype(jnp.float32)
        causal = (start + jnp.arange(chunk))[:, None] >= keys[None, :]
        weights = jax.nn.softmax(jnp.where(causal, scores, jnp.finfo(jnp.float32).min), axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", weights.astype(v.dtype), v)

    chunks = jnp.moveaxis(q.reshape(b, n // chunk, chunk, h, d), 1, 0)
    out = jax.lax.map(one, (chunks, jnp.arange(n // chunk) * chunk))
    return jnp.moveaxis(out, 0, 1).reshape(b, n, h, d)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, target: str = "gpu") -> jax.Array:
    """Causal attention by jax's Pallas flash-attention kernel for ``target``'s chips (GPUs:
    ``jax.experimental.pallas.ops.gpu.attention.mha``, a Triton kernel; TPUs:
    ``jax.experimental.pallas.ops.tpu.flash_attention``, a Mosaic kernel: the scores stay on chip), as a
    JAX user runs attention on them. A kernel is not split by the compiler: under a mesh it runs per
    device in a ``shard_map``, the rows over the mesh's data and FSDP axes, the heads over its tensor
    axis (parallax's axis names), as MaxText wraps its attention kernels."""
    from jax.sharding import PartitionSpec as P

    scale = q.shape[-1] ** -0.5
    if target == "tpu":
        from jax.experimental.pallas.ops.tpu import flash_attention as tpu

        sizes = tpu.BlockSizes(block_q=1024, block_k_major=1024, block_k=512, block_b=1, block_q_major_dkv=1024,
                               block_k_major_dkv=1024, block_k_dkv=512, block_q_dkv=1024, block_k_major_dq=1024,
                               block_k_dq=512, block_q_dq=1024)

        def kernel(q, k, v):  # the kernel's layout: [batch, heads, tokens, head dim]
            heads_first = [jnp.swapaxes(t, 1, 2) for t in (q, k, v)]
            return jnp.swapaxes(tpu.flash_attention(*heads_first, causal=True, sm_scale=scale, block_sizes=sizes), 1, 2)
    else:
        from jax.experimental.pallas.ops.gpu import attention

        def kernel(q, k, v):
            return attention.mha(q, k, v, segment_ids=None, sm_scale=scale, causal=True)

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return kernel(q, k, v)
    free = [a for a in mesh.axis_names if a not in mesh.manual_axes]
    rows = tuple(a for a in free if a in ("data", "fsdp")) or None
    spec = P(rows, None, "tensor" if "tensor" in free else None, None)
    return jax.shard_map(kernel, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, axis_names=set(free),
                         check_vma=False)(q, k, v)  # the kernel says nothing of how its output varies


TORCHTITAN_SELECTIVE = ("wq", "wv", "w1", "w2", "attention")
"""What torchtitan's selective op checkpointing keeps (``_save_list``, "only recompute every other mm": the
block's 1st, 3rd, 5th and 7th matmul outputs) and the attention's output; the rest is recomputed. (Their flash
attention's log-sum-exp is kept too; here the kernel's forward runs again for it.)"""

MAXTEXT_OFFLOADED = ("layer_input", "wq", "wk", "wv", "wo")
"""What MaxText's ``remat_policy: custom`` runs offload to the host (``Shape(offloaded=True)``): each block's
input and the attention's query, key, value and output projections; the rest is recomputed."""


def _kept(x: jax.Array, name: str, shape: Shape) -> jax.Array:
    return jax.ad_checkpoint.checkpoint_name(x, name) if name in shape.saved else x


class Block(nn.Module):
    shape: Shape

    @nn.compact
    def __call__(self, x):
        s, head = self.shape, self.shape.dim // self.shape.heads
        x = _kept(x, "layer_input", s)
        dense = lambda features, name: nn.DenseGeneral(features, use_bias=False, dtype=jnp.dtype(s.dtype), name=name)
        h = RMSNorm(name="attention_norm")(x)
        q = _kept(dense((s.heads, head), "wq")(h), "wq", s)
        k = _kept(dense((s.kv_heads, head), "wk")(h), "wk", s)
        v = _kept(dense((s.kv_heads, head), "wv")(h), "wv", s)
        k, v = (jnp.repeat(t, s.heads // s.kv_heads, axis=2) for t in (k, v))
        if s.flash:
            out = flash_attention(q, k, v, s.flash)
        elif s.chunk:
            out = chunked_attention(q, k, v, s.chunk)
        else:
            mask = nn.make_causal_mask(x[..., 0])
            out = nn.dot_product_attention(q, k, v, mask=mask, dtype=jnp.dtype(s.dtype))
        out = _kept(out, "attention", s)
        x = x + _kept(nn.DenseGeneral(s.dim, axis=(-2, -1), use_bias=False, dtype=jnp.dtype(s.dtype), name="wo")(out),
                      "wo", s)
        h = RMSNorm(name="ffn_norm")(x)
        gated = nn.silu(_kept(dense(s.ffn, "w1")(h), "w1", s)) * _kept(dense(s.ffn, "w3")(h), "w3", s)
        return x + _kept(dense(s.dim, "w2")(gated), "w2", s)


def _policy(shape: Shape):
    if shape.saved and shape.offloaded:
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=list(shape.saved), offload_src="device",
            offload_dst="pinned_host")
    return jax.checkpoint_policies.save_only_these_names(*shape.saved) if shape.saved else None


class ScanBlock(nn.Module):
    shape: Shape

    @nn.compact
    def __call__(self, x, _):
        return Block(self.shape, name="block")(x), None


class Llama(nn.Module):
    """The scanned stack: one block's params stacked over the layers (``nn.scan``)."""

    shape: Shape
    remat: bool = True  # full activation checkpointing, as the published large runs use

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.shape.vocab, self.shape.dim, name="embed")(tokens).astype(jnp.dtype(self.shape.dtype))
        block = nn.remat(ScanBlock, policy=_policy(self.shape)) if self.remat else ScanBlock
        x, _ = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                       length=self.shape.layers)(self.shape, name="layers")(x, None)
        x = RMSNorm(name="norm")(x)
        return nn.Dense(self.shape.vocab, use_bias=False, dtype=jnp.dtype(self.shape.dtype), name="head")(x)


class ListedLlama(nn.Module):
    """The Hugging Face–style list of blocks (``layers_0``, ``layers_1``...)."""

    shape: Shape
    remat: bool = True

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.shape.vocab, self.shape.dim, name="embed")(tokens).astype(jnp.dtype(self.shape.dtype))
        block = nn.remat(Block, policy=_policy(self.shape)) if self.remat else Block
        for i in range(self.shape.layers):
            x = block(self.shape, name=f"layers_{i}")(x)
        x = RMSNorm(name="norm")(x)
        return nn.Dense(self.shape.vocab, use_bias=False, dtype=jnp.dtype(self.shape.dtype), name="head")(x)


def listed_params(stacked: dict, layers: int) -> dict:
    """``Llama``'s params as ``ListedLlama`` holds them: the stack's blocks one per layer (``layers_{i}``)."""
    params = {name: value for name, value in stacked.items() if name != "layers"}
    params.update({f"layers_{i}": jax.tree.map(lambda x, i=i: x[i], stacked["layers"]["block"]) for i in range(layers)})
    return params


def lean_loss_fn(model, batch):
    """``loss_fn`` as ``logsumexp`` minus the label's logit: no float32 log-probabilities over the vocabulary
    are kept (XLA fuses the upcast into the reductions), as MaxText's cross entropy keeps none."""
    logits = model(batch["tokens"][:, :-1])
    labels = batch["tokens"][:, 1:]
    picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0].astype(jnp.float32)
    return (jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1) - picked).mean()


def loss_fn(model, batch):
    logits = model(batch["tokens"][:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()


def batch(global_batch: int, sequence: int) -> dict:
    """One global batch of token ids, as shapes (``sequence`` tokens predicted per row)."""
    return {"tokens": jax.ShapeDtypeStruct((global_batch, sequence + 1), jnp.int32)}
