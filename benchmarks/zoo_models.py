"""The model zoo: models of the shapes people train, generated from a seed.

Each member is a Flax model (linen or NNX) with its loss and a batch, small enough to compile
in seconds on simulated CPU devices. The families: MLPs of square, widening and narrowing
layers and of Megatron pairs; transformer LMs of several widths, head counts, vocabularies,
tied and untied embeddings; an LM of ``nn.scan``-stacked blocks; CNNs with BatchNorm; a
mixture-of-experts layer; NNX versions of the MLP, LM, CNN and MoE. ``zoo(seed)`` draws each
member's sizes from ``seed``; ``zoo(seed, scale=0.25)`` shrinks widths (the tests' copies).

Example:
    >>> members = zoo(0)
    >>> len(members), members[0].name
    (24, 'mlp_square_a')
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.models import Block
from benchmarks.nnx_models import Block as NNXBlock
from benchmarks.nnx_models import classifier_loss, lm_loss

# --- linen -------------------------------------------------------------------------------------


class Stack(nn.Module):
    """Dense layers of the given widths (ReLU between), then a 10-class head."""

    widths: tuple[int, ...]

    @nn.compact
    def __call__(self, x):
        for width in self.widths:
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(10, name="head")(x)


class Megatron(nn.Module):
    """Residual pairs ``up_i`` (features → hidden) / ``down_i`` (hidden → features), then a head."""

    features: int
    hidden: int
    pairs: int = 2

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(self.features, name="stem")(x)
        for index in range(self.pairs):
            x = x + nn.Dense(self.features, name=f"down_{index}")(nn.relu(nn.Dense(self.hidden, name=f"up_{index}")(x)))
        return nn.Dense(10, name="head")(x)


class LM(nn.Module):
    """A decoder-only transformer; ``tied`` reads the logits off the embedding (``Embed.attend``)."""

    vocab: int
    width: int
    heads: int
    layers: int = 2
    tied: bool = False

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(self.vocab, self.width, name="embed")
        x = embed(tokens)
        for index in range(self.layers):
            x = Block(self.heads, name=f"block_{index}")(x)
        x = nn.LayerNorm()(x)
        return embed.attend(x) if self.tied else nn.Dense(self.vocab, name="head")(x)


class ScannedBlock(nn.Module):
    heads: int

    @nn.compact
    def __call__(self, x, _):
        return Block(self.heads)(x), None


class ScanLM(nn.Module):
    """The LM with its blocks stacked by ``nn.scan`` (params gain a leading layer dim)."""

    vocab: int
    width: int
    heads: int
    layers: int = 3

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.width, name="embed")(tokens)
        blocks = nn.scan(ScannedBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.layers)
        x, _ = blocks(self.heads, name="blocks")(x, None)
        return nn.Dense(self.vocab, name="head")(nn.LayerNorm()(x))


class CNN(nn.Module):
    widths: tuple[int, ...]

    @nn.compact
    def __call__(self, x):
        for width in self.widths:
            x = nn.Conv(width, (3, 3), use_bias=False)(x)
            x = nn.BatchNorm(use_running_average=False, momentum=0.9)(x)
            x = nn.max_pool(nn.relu(x), (2, 2), strides=(2, 2))
        return nn.Dense(10, name="head")(x.mean(axis=(1, 2)))


def top1_gates(logits):
    """Softmax router gates with all but each token's top expert zeroed (dense dispatch: exact, simple)."""
    gates = nn.softmax(logits, axis=-1)
    return gates * (gates >= gates.max(axis=-1, keepdims=True))


class MoE(nn.Module):
    """Token embedding, one mixture-of-experts FFN (experts stacked in one (E, d, h) param), head."""

    vocab: int
    width: int
    hidden: int
    experts: int

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.width, name="embed")(tokens)
        h = nn.LayerNorm()(x)
        gates = top1_gates(nn.Dense(self.experts, name="router")(h))
        init = nn.initializers.lecun_normal(batch_axis=(0,))
        w_in = self.param("w_in", init, (self.experts, self.width, self.hidden))
        w_out = self.param("w_out", init, (self.experts, self.hidden, self.width))
        y = jnp.einsum("bteh,ehd->bted", nn.gelu(jnp.einsum("btd,edh->bteh", h, w_in)), w_out)
        x = x + jnp.einsum("bted,bte->btd", y, gates)
        return nn.Dense(self.vocab, name="head")(nn.LayerNorm()(x))


# --- NNX ---------------------------------------------------------------------------------------


class NNXStack(nnx.Module):
    def __init__(self, inputs: int, widths: tuple[int, ...], rngs: nnx.Rngs):
        sizes = (inputs, *widths)
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in itertools.pairwise(sizes)])
        self.head = nnx.Linear(sizes[-1], 10, rngs=rngs)

    def __call__(self, x):
        for layer in self.layers:
            x = nnx.relu(layer(x))
        return self.head(x)


class NNXLM(nnx.Module):
    def __init__(self, vocab: int, width: int, heads: int, rngs: nnx.Rngs, layers: int = 2, tied: bool = False):
        self.embed = nnx.Embed(vocab, width, rngs=rngs)
        self.blocks = nnx.List([NNXBlock(width, heads, rngs) for _ in range(layers)])
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.head = None if tied else nnx.Linear(width, vocab, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        return self.embed.attend(x) if self.head is None else self.head(x)


class NNXCNN(nnx.Module):
    def __init__(self, widths: tuple[int, ...], rngs: nnx.Rngs):
        sizes = (3, *widths)
        self.convs = nnx.List([nnx.Conv(a, b, (3, 3), use_bias=False, rngs=rngs) for a, b in itertools.pairwise(sizes)])
        self.norms = nnx.List([nnx.BatchNorm(b, momentum=0.9, rngs=rngs) for b in widths])
        self.head = nnx.Linear(widths[-1], 10, rngs=rngs)

    def __call__(self, x):
        for conv, norm in zip(self.convs, self.norms):
            x = nnx.max_pool(nnx.relu(norm(conv(x))), (2, 2), strides=(2, 2))
        return self.head(x.mean(axis=(1, 2)))


class NNXMoE(nnx.Module):
    def __init__(self, vocab: int, width: int, hidden: int, experts: int, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal(batch_axis=(0,))
        self.embed = nnx.Embed(vocab, width, rngs=rngs)
        self.norm_0 = nnx.LayerNorm(width, rngs=rngs)
        self.router = nnx.Linear(width, experts, rngs=rngs)
        self.w_in = nnx.Param(init(rngs.params(), (experts, width, hidden)))
        self.w_out = nnx.Param(init(rngs.params(), (experts, hidden, width)))
        self.norm_1 = nnx.LayerNorm(width, rngs=rngs)
        self.head = nnx.Linear(width, vocab, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        h = self.norm_0(x)
        gates = top1_gates(self.router(h))
        y = jnp.einsum("bteh,ehd->bted", nnx.gelu(jnp.einsum("btd,edh->bteh", h, self.w_in[...])), self.w_out[...])
        x = x + jnp.einsum("bted,bte->btd", y, gates)
        return self.head(self.norm_1(x))


# --- the zoo -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Member:
    """One zoo model: ``build()`` returns the model (linen module or NNX constructor), ``loss_fn``
    and ``batch`` go with it; ``config`` is what was drawn from the seed."""

    name: str
    family: str
    api: str
    build: Callable[[], Any]
    loss_fn: Callable
    batch: dict
    config: dict


def _classifier_batch(rng, size: int, shape: tuple[int, ...]) -> dict:
    return {"x": rng.normal(size=(size, *shape)).astype(np.float32), "y": rng.integers(0, 10, size).astype(np.int32)}


def _tokens(rng, size: int, length: int, vocab: int) -> dict:
    return {"x": rng.integers(0, vocab, (size, length + 1)).astype(np.int32)}


def _width(value: float, scale: float, multiple: int = 16) -> int:
    return max(multiple, round(value * scale / multiple) * multiple)


def zoo(seed: int = 0, scale: float = 1.0) -> list[Member]:
    """The 24 members, their sizes drawn from ``seed`` (``scale`` < 1 shrinks every width)."""
    draws = np.random.default_rng(seed)  # the members' sizes: the same draws at every scale
    rng = np.random.default_rng([seed, 1])  # their batches
    pick = lambda options: options[int(draws.integers(len(options)))]
    w = lambda value, multiple=16: _width(value, scale, multiple)
    members: list[Member] = []

    def add(name, family, api, build, loss_fn, batch, **config):
        members.append(Member(name, family, api, build, loss_fn, batch, config))

    # MLPs: square, widening, narrowing, Megatron pairs (linen), and NNX square / widening / narrowing.
    for suffix in "ab":
        width, depth = w(pick([384, 512, 768])), int(pick([3, 4]))
        add(f"mlp_square_{suffix}", "mlp", "linen", lambda width=width, depth=depth: Stack((width,) * depth),
            classifier_loss, _classifier_batch(rng, 64, (width,)), width=width, depth=depth)
    start = w(pick([96, 128]))
    widths = tuple(start * 2 ** i for i in range(1, 5))
    add("mlp_widening", "mlp", "linen", lambda widths=widths: Stack(widths), classifier_loss,
        _classifier_batch(rng, 64, (start,)), widths=widths)
    add("mlp_narrowing", "mlp", "linen", lambda widths=widths: Stack(widths[::-1][1:] + (start,)), classifier_loss,
        _classifier_batch(rng, 64, (widths[-1],)), widths=widths[::-1][1:] + (start,))
    features = w(pick([256, 384]))
    add("mlp_megatron", "mlp", "linen", lambda f=features: Megatron(f, 4 * f), classifier_loss,
        _classifier_batch(rng, 64, (features,)), features=features, hidden=4 * features)
    width = w(pick([384, 512]))
    add("nnx_mlp_square", "mlp", "nnx", lambda width=width: NNXStack(width, (width,) * 3, nnx.Rngs(0)),
        classifier_loss, _classifier_batch(rng, 64, (width,)), width=width, depth=3)
    add("nnx_mlp_widening", "mlp", "nnx", lambda widths=widths, start=start: NNXStack(start, widths, nnx.Rngs(0)),
        classifier_loss, _classifier_batch(rng, 64, (start,)), widths=widths)
    narrowing = widths[::-1][1:] + (start,)
    add("nnx_mlp_narrowing", "mlp", "nnx", lambda n=narrowing, i=widths[-1]: NNXStack(i, n, nnx.Rngs(0)),
        classifier_loss, _classifier_batch(rng, 64, (widths[-1],)), widths=narrowing)

    # Transformer LMs: widths, heads, vocabularies, tied and untied; one scanned; NNX.
    for index, (width, tied) in enumerate([(128, False), (128, True), (192, False), (256, True), (256, False),
                                           (384, False)]):
        width = w(width, 32)
        heads = int(pick([2, 4, 8]))  # drawn whatever the scale (the same draws at every scale), then fitted
        while heads > 1 and width % (8 * heads):
            heads //= 2
        vocab = int(pick([256, 1024, 4096]))
        add(f"lm_{index}", "lm", "linen", lambda v=vocab, d=width, h=heads, t=tied: LM(v, d, h, tied=t), lm_loss,
            _tokens(rng, 16, 32, vocab), width=width, heads=heads, vocab=vocab, tied=tied)
    width, vocab = w(128, 32), int(pick([512, 1024]))
    add("lm_scan", "lm", "linen", lambda v=vocab, d=width: ScanLM(v, d, 4), lm_loss, _tokens(rng, 16, 32, vocab),
        width=width, heads=4, vocab=vocab, layers=3)
    for index, (width, tied) in enumerate([(128, False), (256, True)]):
        width, vocab = w(width, 32), int(pick([512, 2048]))
        add(f"nnx_lm_{index}", "lm", "nnx", lambda v=vocab, d=width, t=tied: NNXLM(v, d, 4, nnx.Rngs(0), tied=t),
            lm_loss, _tokens(rng, 16, 32, vocab), width=width, heads=4, vocab=vocab, tied=tied)

    # CNNs with BatchNorm.
    for index, widths in enumerate([(32, 64, 128), (64, 128, 256)]):
        widths = tuple(w(x) for x in widths)
        add(f"cnn_{index}", "cnn", "linen", lambda widths=widths: CNN(widths), classifier_loss,
            _classifier_batch(rng, 32, (16, 16, 3)), widths=widths)
    widths = tuple(w(x) for x in (32, 64, 128))
    add("nnx_cnn", "cnn", "nnx", lambda widths=widths: NNXCNN(widths, nnx.Rngs(0)), classifier_loss,
        _classifier_batch(rng, 32, (16, 16, 3)), widths=widths)

    # Mixture of experts.
    width, experts, vocab = w(128, 32), int(pick([4, 8])), int(pick([512, 1024]))
    add("moe", "moe", "linen", lambda v=vocab, d=width, e=experts: MoE(v, d, 2 * d, e), lm_loss,
        _tokens(rng, 16, 32, vocab), width=width, experts=experts, vocab=vocab)
    add("nnx_moe", "moe", "nnx", lambda v=vocab, d=width, e=experts: NNXMoE(v, d, 2 * d, e, nnx.Rngs(0)), lm_loss,
        _tokens(rng, 16, 32, vocab), width=width, experts=experts, vocab=vocab)

    # Square hidden layers of 2048 between a narrow input and output, at batch 256 (the MNIST-style MLP
    # a new user brings; google-parallax's FSDP rule, every kernel's output dim under jit, suits it).
    # Fixed sizes, drawn last: the members above keep their draws.
    wide, inputs = w(2048), w(784)
    add("mlp_wide", "mlp", "linen", lambda wide=wide: Stack((wide,) * 3), classifier_loss,
        _classifier_batch(rng, 256, (inputs,)), width=wide, depth=3, inputs=inputs)
    add("nnx_mlp_wide", "mlp", "nnx", lambda wide=wide, inputs=inputs: NNXStack(inputs, (wide,) * 3, nnx.Rngs(0)),
        classifier_loss, _classifier_batch(rng, 256, (inputs,)), width=wide, depth=3, inputs=inputs)
    return members
