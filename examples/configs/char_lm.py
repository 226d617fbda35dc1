"""Config for examples/char_lm.py (override any field: --config.model.layers=4)."""

import ml_collections
from ml_collections.config_dict import placeholder


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.text = placeholder(str)  # a text file; default: the text bundled with Python
    config.strategy = "fsdp+tp"
    config.seq_len = 64
    config.learning_rate = 3e-3
    config.sample_length = 200
    config.sample_prompt = "The "
    config.model = ml_collections.ConfigDict(dict(layers=2, features=128, heads=4, dropout_rate=0.1))
    config.trainer = ml_collections.ConfigDict(dict(
        max_steps=300,
        batch_size=32,
        eval_batch_size=64,
        eval_every=100,
        seed=0,
        checkpoint_dir=placeholder(str),
        checkpoint_every=placeholder(int),
        progress=True,
    ))
    return config
