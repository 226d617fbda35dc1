"""Train a CNN (BatchNorm, dropout) on digits or Fashion-MNIST with any parallax strategy.

    python examples/image_classifier.py --devices 8 --strategy fsdp
    python examples/image_classifier.py --config examples/configs/image_classifier.py \\
        --config.dataset=fashion_mnist --config.trainer.epochs=2 --strategy dp+fsdp
    python examples/image_classifier.py --config.pipeline=grain --config.trainer.checkpoint_dir=/tmp/ckpt
    python examples/image_classifier.py --config.pipeline=grain --config.trainer.checkpoint_dir=/tmp/ckpt --resume

Digits ship with scikit-learn; Fashion-MNIST comes from Debian's dataset-fashion-mnist
package (``apt-get install dataset-fashion-mnist``), and the script falls back to digits
when it is missing. ``--config.pipeline=grain`` reads the training set through a Grain
``MapDataset`` of single examples (parallax batches, shuffles and splits it over processes);
killed and started again with ``--resume``, it continues at the batch it stopped at, reading
nothing twice.
"""

from __future__ import annotations

import os
import time

import _setup
import data
import flax.linen as nn
import optax
from absl import app, flags, logging
from ml_collections import config_flags

import parallax as px

config_flags.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "configs", "image_classifier.py"), "training config"
)
flags.DEFINE_bool("resume", False, "continue from the newest checkpoint in --config.trainer.checkpoint_dir")
FLAGS = flags.FLAGS


class CNN(nn.Module):
    """A plain image classifier: conv blocks with BatchNorm, global pooling, dropout, dense."""

    classes: int = 10
    features: tuple = (32, 64)
    dropout_rate: float = 0.1

    @nn.compact
    def __call__(self, x, train: bool = True):
        for width in self.features:
            x = nn.Conv(width, (3, 3), use_bias=False)(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
            x = nn.relu(x)
            if x.shape[1] > 4:
                x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = x.mean(axis=(1, 2))
        x = nn.Dropout(self.dropout_rate, deterministic=not train)(x)
        return nn.Dense(self.classes)(x)


# Cross-entropy and accuracy are means of per-example terms: marked, each data shard may compute
# its own (faster for data parallelism; BatchNorm still normalises over the global batch).
@px.per_example_loss
def train_loss(model, batch):
    logits = model(batch["image"], train=True)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, {"accuracy": (logits.argmax(-1) == batch["label"]).mean()}


@px.per_example_loss
def eval_loss(model, batch):
    logits = model(batch["image"], train=False)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, {"accuracy": (logits.argmax(-1) == batch["label"]).mean()}


def load(name: str):
    if name == "fashion_mnist":
        found = data.fashion_mnist()
        if found is not None:
            return found
        logging.warning("Fashion-MNIST not found in %s (install it with `apt-get install "
                        "dataset-fashion-mnist`); using digits instead.", data.FASHION_MNIST_DIR)
    elif name != "digits":
        raise ValueError(f"dataset={name!r}; use 'digits' or 'fashion_mnist'.")
    return data.digits()


def grain_dataset(arrays: dict):
    """The examples as Grain reads a dataset on disk: random access, one example per index (here
    each decoded from the arrays by a map; a real pipeline would parse a record file)."""
    import grain

    return grain.MapDataset.range(len(arrays["label"])).map(lambda i: {k: v[i] for k, v in arrays.items()})


def main(argv):
    del argv
    _setup.quiet_logs()
    config = FLAGS.config
    strategy = _setup.strategy_from_name(FLAGS.strategy or config.strategy)  # TP: layout read from the model
    train, test = load(config.dataset)
    print(f"parallax: {config.dataset} ({len(train['label'])} train / {len(test['label'])} test) with "
          f"{_setup.describe_run(strategy)}", flush=True)
    model = CNN(features=tuple(config.features), dropout_rate=config.dropout_rate)
    steps = config.trainer.max_steps or config.trainer.epochs * (len(train["label"]) // config.trainer.batch_size)
    schedule = optax.warmup_cosine_decay_schedule(0.0, config.learning_rate, min(100, steps // 10), max(steps, 1))
    trainer = px.Trainer(model, optax.adamw(schedule, weight_decay=config.weight_decay), train_loss,
                         strategy=strategy, eval_loss_fn=eval_loss, config=config.trainer)
    start = time.perf_counter()
    train_data = grain_dataset(train) if config.pipeline == "grain" else train
    result = trainer.fit(train_data, eval_data=test, resume=FLAGS.resume)
    metrics = result.history.eval[-1]  # fit evaluates the whole test set at the end
    print(f"test accuracy {metrics['accuracy']:.4f}, test loss {metrics['loss']:.4f} after "
          f"{int(result.state.step)} steps in {time.perf_counter() - start:.1f}s", flush=True)


if __name__ == "__main__":
    app.run(main)
