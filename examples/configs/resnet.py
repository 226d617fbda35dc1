"""Config for examples/resnet.py."""

import ml_collections
from ml_collections.config_dict import placeholder


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.dataset = "fashion_mnist"  # falls back to digits (upsampled to 32x32) when missing
    config.strategy = "dp+fsdp"
    config.depth = 18
    config.hidden_sizes = (16, 32, 64, 128)
    config.learning_rate = 1e-3
    config.train_examples = 8192  # a subset keeps the CPU demo short; 0 = all
    config.trainer = ml_collections.ConfigDict(dict(
        epochs=1,
        max_steps=placeholder(int),
        batch_size=64,
        eval_batch_size=512,
        eval_every=placeholder(int),
        seed=0,
        checkpoint_dir=placeholder(str),
        checkpoint_every=placeholder(int),
        progress=True,
    ))
    return config
