"""The benchmark models: a ~10M-param MLP, a small transformer LM, a CNN, a Switch-style mixture of listed experts."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax


class MLP(nn.Module):
    """Two Megatron pairs (up: column, down: row) and a head: 9.5M params at width 768."""

    features: int = 768
    hidden: int = 3072
    classes: int = 10

    @nn.compact
    def __call__(self, x, train: bool = True):
        for index in range(2):
            h = nn.relu(nn.Dense(self.hidden, name=f"up_{index}")(x))
            x = x + nn.Dense(self.features, name=f"down_{index}")(h)
        return nn.Dense(self.classes, name="head")(x)


class Block(nn.Module):
    heads: int

    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads, name="attn")(h, h, mask=mask)
        h = nn.LayerNorm()(x)
        return x + nn.Dense(x.shape[-1], name="down")(nn.gelu(nn.Dense(4 * x.shape[-1], name="up")(h)))


class TransformerLM(nn.Module):
    vocab: int = 512
    features: int = 256
    layers: int = 2
    heads: int = 8

    @nn.compact
    def __call__(self, tokens, train: bool = True):
        x = nn.Embed(self.vocab, self.features, name="embed")(tokens)
        for index in range(self.layers):
            x = Block(self.heads, name=f"block_{index}")(x)
        return nn.Dense(self.vocab, name="head")(nn.LayerNorm()(x))


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        for width in (32, 64, 128):
            x = nn.Conv(width, (3, 3), use_bias=False)(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
            x = nn.max_pool(nn.relu(x), (2, 2), strides=(2, 2))
        return nn.Dense(10, name="head")(x.mean(axis=(1, 2)))


class Expert(nn.Module):
    width: int
    hidden: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.width, use_bias=False)(nn.gelu(nn.Dense(self.hidden, use_bias=False)(x)))


class ListedSwitch(nn.Module):
    """A Switch-style mixture (top-1 routing, a capacity of 1.25x per row of tokens, one-hot
    dispatch) whose 8 experts are a list of ``Expert`` modules, each called on its own slots."""

    width: int = 32
    hidden: int = 64
    experts: int = 8

    @nn.compact
    def __call__(self, tokens, train: bool = True):
        x = nn.Embed(64, self.width)(tokens)
        h = nn.LayerNorm()(x)
        probs = jax.nn.softmax(nn.Dense(self.experts, use_bias=False, name="router")(h))
        capacity = max(1, int(1.25 * h.shape[1] / self.experts))
        chosen = jax.nn.one_hot(jnp.argmax(probs, -1), self.experts)
        slot = (jnp.cumsum(chosen, axis=1) - 1) * chosen
        # row, token, e, slot
        combine = (probs * chosen * (slot < capacity))[..., None] * jax.nn.one_hot(slot, capacity)
        mask = (combine > 0).astype(h.dtype)
        y = 0
        for i in range(self.experts):
            slots = jnp.einsum("gtc,gtd->gcd", mask[:, :, i], h)
            y = y + jnp.einsum("gcd,gtc->gtd", Expert(self.width, self.hidden, name=f"expert_{i}")(slots),
                               combine[:, :, i])
        return nn.Dense(64, name="head")(nn.LayerNorm()(x + y))


def classifier_loss(model, batch):
    logits = model(batch["x"], train=True)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def lm_loss(model, batch):
    logits = model(batch["x"][:, :-1], train=True)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["x"][:, 1:]).mean()


def make_batch(kind: str, batch_size: int, scale: float = 1.0, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    if kind == "mlp":
        return {"x": rng.normal(size=(batch_size, int(768 * scale))).astype(np.float32),
                "y": rng.integers(0, 10, batch_size).astype(np.int32)}
    if kind == "lm":
        return {"x": rng.integers(0, 512, (batch_size, int(64 * scale) + 1)).astype(np.int32)}
    if kind == "cnn":
        side = max(8, int(32 * scale))
        return {"x": rng.normal(size=(batch_size, side, side, 3)).astype(np.float32),
                "y": rng.integers(0, 10, batch_size).astype(np.int32)}
    raise ValueError(kind)


def build(kind: str, scale: float = 1.0):
    """``(model, loss_fn, tp_rules)``; ``scale`` < 1 shrinks the model (smoke tests)."""
    if kind == "mlp":
        return MLP(features=int(768 * scale), hidden=int(3072 * scale)), classifier_loss, None
    if kind == "lm":
        width = max(32, int(256 * scale))
        return TransformerLM(features=width, heads=8 if width >= 64 else 4), lm_loss, None
    if kind == "cnn":
        rules = [(r"Conv_1/kernel$", (None, None, None, "tensor")), (r"Conv_2/kernel$", (None, None, "tensor", None))]
        return CNN(), classifier_loss, rules
    raise ValueError(kind)
