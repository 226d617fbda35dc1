"""A small decoder-only transformer language model on characters, with tensor parallelism.

    python examples/char_lm.py --devices 8                      # FSDP x TP on Python's own docs
    python examples/char_lm.py --devices 8 --strategy tp --text my_book.txt
    python examples/char_lm.py --config examples/configs/char_lm.py --config.model.layers=4

Attention projections are split by heads and the MLP column/row-wise (Megatron), a layout
parallax reads from the model's computation: the model has no parallelism in its code.
Prints a generated sample at the end.
"""

from __future__ import annotations

import os
import time

import _setup
import data
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from ml_collections import config_flags

import parallax as px

config_flags.DEFINE_config_file("config", os.path.join(os.path.dirname(__file__), "configs", "char_lm.py"),
                                "training config")
flags.DEFINE_string("text", None, "train on this text file instead of the default text")
FLAGS = flags.FLAGS


class Block(nn.Module):
    heads: int
    dropout_rate: float

    @nn.compact
    def __call__(self, x, train: bool):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(num_heads=self.heads, dropout_rate=self.dropout_rate,
                                            deterministic=not train, name="attn")(h, h, mask=mask)
        x = x + nn.Dropout(self.dropout_rate, deterministic=not train)(h)
        h = nn.LayerNorm()(x)
        h = nn.Dense(4 * x.shape[-1], name="up")(h)
        h = nn.Dense(x.shape[-1], name="down")(nn.gelu(h))
        return x + nn.Dropout(self.dropout_rate, deterministic=not train)(h)


class CharLM(nn.Module):
    vocab: int
    seq_len: int
    layers: int = 2
    features: int = 128
    heads: int = 4
    dropout_rate: float = 0.1

    @nn.compact
    def __call__(self, tokens, train: bool = True):
        x = nn.Embed(self.vocab, self.features, name="embed")(tokens)
        positions = self.param("positions", nn.initializers.normal(0.02), (self.seq_len, self.features))
        x = x + positions[: tokens.shape[1]]
        for index in range(self.layers):
            x = Block(self.heads, self.dropout_rate, name=f"block_{index}")(x, train)
        return nn.Dense(self.vocab, name="head")(nn.LayerNorm()(x))


def next_char_loss(model, batch, train=True):
    tokens = batch["tokens"]
    logits = model(tokens[:, :-1], train=train)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    return loss, {"accuracy": (logits.argmax(-1) == tokens[:, 1:]).mean()}


def eval_loss(model, batch):
    return next_char_loss(model, batch, train=False)


def encode(text: str, seq_len: int, seed: int):
    chars = sorted(set(text))
    vocab = -(-len(chars) // 8) * 8  # pad so that 8 tensor shards divide the vocabulary
    ids = np.array([chars.index(c) for c in text], dtype=np.int32)
    windows = len(ids) // (seq_len + 1)
    sequences = ids[: windows * (seq_len + 1)].reshape(windows, seq_len + 1)
    order = np.random.default_rng(seed).permutation(windows)
    split = max(1, windows // 20)
    return chars, vocab, {"tokens": sequences[order[split:]]}, {"tokens": sequences[order[:split]]}


def generate(model, params, chars, prompt: str, length: int, seq_len: int, seed: int = 0) -> str:
    """Samples ``length`` characters after ``prompt`` (temperature 0.8) on one device."""
    params = jax.device_put(jax.device_get(params), jax.devices()[0])
    forward = jax.jit(lambda p, t: model.apply({"params": p}, t, train=False))
    tokens = [chars.index(c) for c in prompt if c in chars] or [0]
    key = jax.random.PRNGKey(seed)
    for _ in range(length):
        context = tokens[-seq_len:]
        window = np.zeros((1, seq_len), np.int32)
        window[0, : len(context)] = context
        logits = forward(params, window)[0, len(context) - 1, : len(chars)]
        key, sample_key = jax.random.split(key)
        tokens.append(int(jax.random.categorical(sample_key, logits / 0.8)))
    return "".join(chars[t] for t in tokens)


def main(argv):
    del argv
    _setup.quiet_logs()
    config = FLAGS.config
    path = FLAGS.text or config.text
    if path:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    else:
        text = data.default_text()
    chars, vocab, train, valid = encode(text, config.seq_len, config.trainer.seed)
    strategy = _setup.strategy_from_name(FLAGS.strategy or config.strategy)
    print(f"parallax: {len(text):,} characters ({len(chars)} distinct) from {path or 'pydoc_data.topics'}; "
          f"{_setup.describe_run(strategy)}", flush=True)
    model = CharLM(vocab=vocab, seq_len=config.seq_len, **config.model)
    steps = config.trainer.max_steps
    schedule = optax.warmup_cosine_decay_schedule(0.0, config.learning_rate, min(30, steps // 10), steps)
    trainer = px.Trainer(model, optax.adamw(schedule), next_char_loss, strategy=strategy, eval_loss_fn=eval_loss,
                         config=config.trainer)
    start = time.perf_counter()
    result = trainer.fit(train, eval_data=valid)
    metrics = result.history.eval[-1]
    print(f"validation loss {metrics['loss']:.3f} ({metrics['loss'] / np.log(2):.2f} bits/char), accuracy "
          f"{metrics['accuracy']:.3f} after {int(result.state.step)} steps in {time.perf_counter() - start:.1f}s")
    sample = generate(model, result.state.params, chars, config.sample_prompt, config.sample_length, config.seq_len)
    print("sample:\n" + sample, flush=True)


if __name__ == "__main__":
    app.run(main)
