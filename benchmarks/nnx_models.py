"""The benchmark MLP and transformer LM written in Flax NNX: the same networks as
``benchmarks/models.py`` (same shapes, same param count), for the linen-against-NNX runner."""

from __future__ import annotations

import jax.numpy as jnp
import optax
from flax import nnx


class MLP(nnx.Module):
    """Two Megatron pairs (``up_i`` / ``down_i``) with residuals and a head, as the linen MLP."""

    def __init__(self, rngs: nnx.Rngs, features: int = 768, hidden: int = 3072, classes: int = 10):
        self.up_0 = nnx.Linear(features, hidden, rngs=rngs)
        self.down_0 = nnx.Linear(hidden, features, rngs=rngs)
        self.up_1 = nnx.Linear(features, hidden, rngs=rngs)
        self.down_1 = nnx.Linear(hidden, features, rngs=rngs)
        self.head = nnx.Linear(features, classes, rngs=rngs)

    def __call__(self, x):
        x = x + self.down_0(nnx.relu(self.up_0(x)))
        x = x + self.down_1(nnx.relu(self.up_1(x)))
        return self.head(x)


class Block(nnx.Module):
    def __init__(self, features: int, heads: int, rngs: nnx.Rngs):
        self.norm_0 = nnx.LayerNorm(features, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, features, decode=False, rngs=rngs)
        self.norm_1 = nnx.LayerNorm(features, rngs=rngs)
        self.up = nnx.Linear(features, 4 * features, rngs=rngs)
        self.down = nnx.Linear(4 * features, features, rngs=rngs)

    def __call__(self, x):
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        x = x + self.attn(self.norm_0(x), mask=mask)
        return x + self.down(nnx.gelu(self.up(self.norm_1(x))))


class TransformerLM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, vocab: int = 512, features: int = 256, layers: int = 2, heads: int = 8):
        self.embed = nnx.Embed(vocab, features, rngs=rngs)
        self.blocks = nnx.List([Block(features, heads, rngs) for _ in range(layers)])
        self.norm = nnx.LayerNorm(features, rngs=rngs)
        self.head = nnx.Linear(features, vocab, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def classifier_loss(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def lm_loss(model, batch):
    logits = model(batch["x"][:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["x"][:, 1:]).mean()


def train_step(loss_fn):
    """The plain NNX train step the peers' runners time: ``value_and_grad`` and ``optimizer.update``
    under ``nnx.jit``; ``step(model, optimizer, batch) -> loss``."""

    @nnx.jit
    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    return step


def build(kind: str, scale: float = 1.0):
    """``(function that builds the NNX model, loss_fn)``: the NNX twin of ``models.build(kind, scale)``."""
    if kind == "mlp":
        return lambda: MLP(nnx.Rngs(0), features=int(768 * scale), hidden=int(3072 * scale)), classifier_loss
    if kind == "lm":
        width = max(32, int(256 * scale))
        return lambda: TransformerLM(nnx.Rngs(0), features=width, heads=8 if width >= 64 else 4), lm_loss
    raise ValueError(f"no NNX version of benchmark model {kind!r}; choose mlp or lm.")
