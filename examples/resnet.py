"""Train a ResNet from a published Flax package (jax-resnet), unchanged, with parallax.

    python examples/resnet.py --devices 8 --strategy dp+fsdp
    python examples/resnet.py --devices 8 --strategy fsdp --config.trainer.max_steps=50

The model comes from ``pip install jax-resnet``: its BatchNorm trains when the
``batch_stats`` collection is mutable, which parallax's train step makes it (and its
eval step does not). parallax gives it the global batch's statistics under every
strategy. For tensor parallelism every conv is split over its output channels.
"""

from __future__ import annotations

import os
import time

import _setup
import data
import numpy as np
import optax
from absl import app, flags, logging
from ml_collections import config_flags

import parallax as px

config_flags.DEFINE_config_file("config", os.path.join(os.path.dirname(__file__), "configs", "resnet.py"),
                                "training config")
FLAGS = flags.FLAGS


def loss_fn(model, batch):
    logits = model(batch["image"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, {"accuracy": (logits.argmax(-1) == batch["label"]).mean()}


def load(name: str, train_examples: int):
    found = data.fashion_mnist() if name == "fashion_mnist" else None
    if found is None:
        if name == "fashion_mnist":
            logging.warning("Fashion-MNIST not found in %s (apt-get install dataset-fashion-mnist); using digits.",
                            data.FASHION_MNIST_DIR)
        train, test = data.digits()
        upsample = lambda split: {**split, "image": np.kron(split["image"], np.ones((1, 4, 4, 1), np.float32))}
        found = upsample(train), upsample(test)
    train, test = found
    if train_examples:
        train = {k: v[:train_examples] for k, v in train.items()}
    return train, test


def main(argv):
    del argv
    _setup.quiet_logs()
    import jax_resnet  # the published model, used as it is

    config = FLAGS.config
    strategy = _setup.strategy_from_name(FLAGS.strategy or config.strategy)  # TP: layout read from the convs
    train, test = load(config.dataset, config.train_examples)
    model = getattr(jax_resnet, f"ResNet{config.depth}")(n_classes=10, hidden_sizes=tuple(config.hidden_sizes))
    print(f"parallax: jax_resnet.ResNet{config.depth} on {config.dataset} ({len(train['label'])} train images) "
          f"with {_setup.describe_run(strategy)}", flush=True)
    trainer = px.Trainer(model, optax.adam(config.learning_rate), loss_fn, strategy=strategy, config=config.trainer)
    start = time.perf_counter()
    result = trainer.fit(train, eval_data=test)
    metrics = result.history.eval[-1]
    print(f"test accuracy {metrics['accuracy']:.4f}, test loss {metrics['loss']:.4f} after "
          f"{int(result.state.step)} steps in {time.perf_counter() - start:.1f}s", flush=True)


if __name__ == "__main__":
    app.run(main)
