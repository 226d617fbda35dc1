"""Small models people actually write, and loss functions for them."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax


class MLP(nn.Module):
    hidden: int = 64
    classes: int = 10

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.relu(nn.Dense(self.hidden, name="up")(x))
        x = nn.relu(nn.Dense(self.hidden, name="hidden")(x))
        return nn.Dense(self.classes, name="down")(x)


class ScannedBlock(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return h + nn.Dense(h.shape[-1], name="down")(nn.relu(nn.Dense(2 * h.shape[-1], name="up")(h))), None


class StackedMLP(nn.Module):
    """An MLP whose hidden blocks are one ``nn.scan`` stack (what PipelineParallel splits over stages)."""

    hidden: int = 32
    layers: int = 4
    classes: int = 10

    @nn.compact
    def __call__(self, x, train: bool = True):
        h = nn.Dense(self.hidden, name="embed")(x)
        blocks = nn.scan(ScannedBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.layers)
        h, _ = blocks(name="blocks")(h, None)
        return nn.Dense(self.classes, name="head")(h)


class CNN(nn.Module):
    """Conv → BatchNorm → Dropout, as in an image classifier."""

    classes: int = 10
    dropout_rate: float = 0.0

    @nn.compact
    def __call__(self, x, train: bool = True):
        for features in (8, 16):
            x = nn.Conv(features, (3, 3), use_bias=False)(x)  # BN follows: no bias
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
            x = nn.relu(x)
        x = x.mean(axis=(1, 2))
        x = nn.Dropout(self.dropout_rate, deterministic=not train)(x)
        return nn.Dense(self.classes, name="head")(x)


class Block(nn.Module):
    heads: int = 4
    dropout_rate: float = 0.0

    @nn.compact
    def __call__(self, x, train: bool = True):
        features = x.shape[-1]
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(
            num_heads=self.heads, dropout_rate=self.dropout_rate, deterministic=not train, name="attn"
        )(h, h, mask=mask)
        x = x + nn.Dropout(self.dropout_rate, deterministic=not train)(h)
        h = nn.LayerNorm()(x)
        h = nn.Dense(4 * features, name="up")(h)
        h = nn.Dense(features, name="down")(nn.gelu(h))
        return x + nn.Dropout(self.dropout_rate, deterministic=not train)(h)


class TinyLM(nn.Module):
    """Embedding, one transformer block with attention and dropout, LM head."""

    vocab: int = 64
    features: int = 32
    dropout_rate: float = 0.0

    @nn.compact
    def __call__(self, tokens, train: bool = True):
        x = nn.Embed(self.vocab, self.features, name="embed")(tokens)
        x = Block(dropout_rate=self.dropout_rate, name="block")(x, train)
        x = nn.LayerNorm()(x)
        return nn.Dense(self.vocab, name="head")(x)


def classifier_loss(model, batch):
    logits = model(batch["x"], train=True)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, {"accuracy": (logits.argmax(-1) == batch["y"]).mean()}


def lm_loss(model, batch):
    logits = model(batch["x"][:, :-1], train=True)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["x"][:, 1:]).mean()
    return loss, {"accuracy": (logits.argmax(-1) == batch["x"][:, 1:]).mean()}


def batches(kind: str, steps: int, batch_size: int = 16, seed: int = 0) -> list[dict]:
    """Deterministic random batches for ``kind`` in {"mlp", "cnn", "lm"}."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        if kind == "mlp":
            out.append({"x": rng.normal(size=(batch_size, 24)).astype(np.float32),
                        "y": rng.integers(0, 10, batch_size).astype(np.int32)})
        elif kind == "cnn":
            out.append({"x": rng.normal(size=(batch_size, 8, 8, 1)).astype(np.float32),
                        "y": rng.integers(0, 10, batch_size).astype(np.int32)})
        elif kind == "lm":
            out.append({"x": rng.integers(0, 64, (batch_size, 9)).astype(np.int32)})
        else:
            raise ValueError(kind)
    return out


MODELS = {
    "mlp": (MLP, classifier_loss),
    "cnn": (CNN, classifier_loss),
    "lm": (TinyLM, lm_loss),
}
