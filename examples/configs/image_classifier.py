"""Config for examples/image_classifier.py (override any field: --config.batch_size=256)."""

import ml_collections
from ml_collections.config_dict import placeholder


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.dataset = "digits"  # or "fashion_mnist" (Debian package dataset-fashion-mnist)
    config.pipeline = "arrays"  # or "grain": a grain.MapDataset of examples, batched and shuffled by parallax
    config.strategy = "fsdp"
    config.learning_rate = 3e-3
    config.weight_decay = 1e-4
    config.dropout_rate = 0.1
    config.features = (32, 64)
    config.trainer = ml_collections.ConfigDict(dict(
        epochs=15,
        max_steps=placeholder(int),  # set to stop earlier than `epochs`
        batch_size=64,
        eval_batch_size=256,
        eval_every=100,
        seed=0,
        checkpoint_dir=placeholder(str),
        checkpoint_every=placeholder(int),
        progress=True,
    ))
    return config
