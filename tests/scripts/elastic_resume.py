"""Resumes elastic-test checkpoints in a process with its own number of simulated devices.

usage: elastic_resume.py DEVICES OUT.npz NAME=CKPT_DIR [NAME=CKPT_DIR ...]

Each NAME is a model of tests/test_elastic.py; its run resumes from CKPT_DIR under FSDP on
all DEVICES and writes its loss trajectory and final params to OUT.npz.
"""

import os
import sys

os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={int(sys.argv[1])}"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import logging

import jax
import numpy as np

import parallax as px
from tests.test_elastic import make_trainer, train_data


def main(argv):
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", force=True)
    assert jax.device_count() == int(argv[0]), jax.devices()
    out = {}
    for spec in argv[2:]:
        name, ckpt = spec.split("=", 1)
        result = make_trainer(name, px.FSDP(min_weight_size=64), ckpt).fit(train_data(name), resume=True)
        out[f"{name}::losses"] = np.array([h["loss"] for h in result.history.train])
        for path, value in jax.tree_util.tree_flatten_with_path(jax.device_get(result.state.params))[0]:
            out[f"{name}::{jax.tree_util.keystr(path)}"] = np.asarray(value)
    np.savez(argv[1], **out)


if __name__ == "__main__":
    main(sys.argv[1:])
