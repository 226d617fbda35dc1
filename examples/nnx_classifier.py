"""Train a Flax NNX CNN (BatchNorm, dropout) on digits with any parallax strategy.

    python examples/nnx_classifier.py --devices 8 --strategy fsdp
    python examples/nnx_classifier.py --strategy fsdp+tp --config.trainer.epochs=5

The same network as ``image_classifier.py``, written in NNX: the module is passed to the
Trainer as it is, trained in place, and used afterwards as any NNX module (here: evaluated
on the test set in eval mode, on the host).
"""

from __future__ import annotations

import itertools
import os
import time

import _setup
import data
import jax
import numpy as np
import optax
from absl import app, flags
from flax import nnx
from ml_collections import config_flags

import parallax as px

config_flags.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "configs", "image_classifier.py"), "training config"
)
FLAGS = flags.FLAGS


class CNN(nnx.Module):
    """Conv blocks with BatchNorm, global pooling, dropout, dense."""

    def __init__(self, rngs: nnx.Rngs, classes: int = 10, features: tuple = (32, 64), dropout_rate: float = 0.1):
        widths = (1, *features)
        self.convs = nnx.List([nnx.Conv(a, b, (3, 3), use_bias=False, rngs=rngs)
                               for a, b in itertools.pairwise(widths)])
        self.norms = nnx.List([nnx.BatchNorm(b, momentum=0.9, rngs=rngs) for b in features])
        self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)
        self.head = nnx.Linear(features[-1], classes, rngs=rngs)

    def __call__(self, x):
        for conv, norm in zip(self.convs, self.norms):
            x = nnx.relu(norm(conv(x)))
            if x.shape[1] > 4:
                x = nnx.max_pool(x, (2, 2), strides=(2, 2))
        return self.head(self.dropout(x.mean(axis=(1, 2))))


# The trainer puts the module in train mode for training steps and eval mode for evaluation
# (BatchNorm's running statistics, no dropout); the loss only calls it.
@px.per_example_loss
def loss_fn(model, batch):
    logits = model(batch["image"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, {"accuracy": (logits.argmax(-1) == batch["label"]).mean()}


def main(argv):
    del argv
    _setup.quiet_logs()
    config = FLAGS.config
    strategy = _setup.strategy_from_name(FLAGS.strategy or config.strategy)
    train, test = data.digits()
    print(f"parallax: NNX CNN on digits ({len(train['label'])} train / {len(test['label'])} test) with "
          f"{_setup.describe_run(strategy)}", flush=True)
    model = CNN(nnx.Rngs(config.trainer.seed, dropout=config.trainer.seed + 1), features=tuple(config.features),
                dropout_rate=config.dropout_rate)
    steps = config.trainer.max_steps or config.trainer.epochs * (len(train["label"]) // config.trainer.batch_size)
    schedule = optax.warmup_cosine_decay_schedule(0.0, config.learning_rate, min(100, steps // 10), max(steps, 1))
    trainer = px.Trainer(model, optax.adamw(schedule, weight_decay=config.weight_decay), loss_fn,
                         strategy=strategy, config=config.trainer)
    start = time.perf_counter()
    result = trainer.fit(train, eval_data=test)
    metrics = result.history.eval[-1]
    print(f"test accuracy {metrics['accuracy']:.4f}, test loss {metrics['loss']:.4f} after "
          f"{int(result.state.step)} steps in {time.perf_counter() - start:.1f}s", flush=True)

    # `model` now holds the trained values: use it as any NNX module, e.g. on the host.
    graphdef, values = nnx.split(model)
    model = nnx.merge(graphdef, jax.device_get(values))
    model.eval()
    accuracy = float(np.mean(np.asarray(model(test["image"]).argmax(-1)) == test["label"]))
    print(f"the trained NNX module itself, in eval mode: test accuracy {accuracy:.4f}", flush=True)


if __name__ == "__main__":
    app.run(main)
