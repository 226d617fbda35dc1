"""Elastic resume: a run checkpointed on 8 devices resumes on 4 and trains the same.

The uninterrupted runs (FSDP on 8 simulated devices, checkpoints at steps 3 and 6, data
shuffled over two epochs) are the reference; each resumed run starts from step 3 on another
mesh and must end with the same losses and params (≤1e-5): a plain MLP, a CNN with
BatchNorm, and the CNN with dropout (the loss is not marked per-example, so the ``jit`` path
draws one mask for the global batch, whatever the device count).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest

import parallax as px
from tests.environment import child_env
from tests.models import CNN, MLP, batches, classifier_loss
from tests.reference import TOL, max_diff

pytestmark = pytest.mark.core

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {"mlp": (MLP, {}, "mlp"), "batchnorm": (CNN, {}, "cnn"), "dropout": (CNN, {"dropout_rate": 0.5}, "cnn")}
STEPS, EVERY, BATCH = 6, 3, 32


def train_data(name: str) -> dict:
    return batches(MODELS[name][2], 1, 3 * BATCH, seed=1)[0]  # 3 steps per epoch: the resume crosses an epoch


def make_trainer(name: str, strategy, ckpt: str, devices=None, **options) -> px.Trainer:
    cls, kwargs, _ = MODELS[name]
    return px.Trainer(cls(**kwargs), optax.adamw(3e-3), classifier_loss, strategy=strategy, devices=devices,
                      max_steps=STEPS, batch_size=BATCH, checkpoint_dir=ckpt, checkpoint_every=EVERY,
                      progress=False, **options)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Per model: the step-3 checkpoint directory, and the 8-device run's losses and final params."""
    runs = {}
    for name in MODELS:
        ckpt = tmp_path_factory.mktemp(name) / "ckpt"
        result = make_trainer(name, px.FSDP(min_weight_size=64), str(ckpt)).fit(train_data(name))
        shutil.rmtree(ckpt / str(STEPS))
        runs[name] = (ckpt, np.array([h["loss"] for h in result.history.train]), jax.device_get(result.state.params))
    assert np.abs(runs["dropout"][1] - runs["batchnorm"][1]).max() > 1e-3  # dropout is on: it changes the training
    return runs


def copy_of(ckpt, tmp_path, name):
    target = tmp_path / f"{name}-ckpt"
    shutil.copytree(ckpt, target)
    return str(target)


def assert_same_training(name, uninterrupted, losses, params):
    _, ref_losses, ref_params = uninterrupted[name]
    loss_diff = float(np.abs(np.asarray(losses) - ref_losses[EVERY:]).max())
    param_diff = max_diff(params, ref_params)
    print(f"{name}: resumed vs uninterrupted: loss {loss_diff:.2e}, params {param_diff:.2e}")
    assert len(losses) == STEPS - EVERY and loss_diff <= TOL and param_diff <= TOL, (name, loss_diff, param_diff)


@pytest.mark.wide("a resume in a process of its own (17 s cold)")
def test_resumed_on_4_devices_in_another_process_trains_the_same(uninterrupted, tmp_path):
    copies = {name: copy_of(uninterrupted[name][0], tmp_path, name) for name in MODELS}
    out = tmp_path / "resumed.npz"
    env = child_env()
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "scripts", "elastic_resume.py"), "4", str(out),
                           *(f"{name}={path}" for name, path in copies.items())],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert ("Resuming on 4 devices (4 data shards); the checkpoint's run had 8 devices (8 data shards, grad_accum 1). "
            "Global batch 32 kept: 8 rows per data shard and microbatch.") in proc.stderr
    saved = np.load(out)
    for name in MODELS:
        _, _, ref_params = uninterrupted[name]
        flat = jax.tree_util.tree_flatten_with_path(ref_params)[0]
        params = jax.tree.unflatten(jax.tree.structure(ref_params),
                                    [saved[f"{name}::{jax.tree_util.keystr(path)}"] for path, _ in flat])
        assert_same_training(name, uninterrupted, saved[f"{name}::losses"], params)
    record = px.checkpoint.Checkpointer(copies["mlp"]).read_metadata(STEPS)
    assert record["elastic"]["from"]["devices"] == 8 and record["elastic"]["to"]["data_shards"] == 4
    assert record["layout"] == {"devices": 4, "data_shards": 4, "grad_accum": 1}


def test_resumed_on_a_dp_by_fsdp_mesh_trains_the_same(uninterrupted, tmp_path):
    strategy = px.combine(px.DataParallel(2), px.FSDP(2, min_weight_size=64))
    for name in MODELS:
        trainer = make_trainer(name, strategy, copy_of(uninterrupted[name][0], tmp_path, name),
                               devices=jax.devices()[:4])
        result = trainer.fit(train_data(name), resume=True)
        assert_same_training(name, uninterrupted, [h["loss"] for h in result.history.train],
                             jax.device_get(result.state.params))


def test_accumulate_keeps_the_rows_per_device_and_the_training(uninterrupted, tmp_path, caplog):
    trainer = make_trainer("mlp", px.FSDP(min_weight_size=64), copy_of(uninterrupted["mlp"][0], tmp_path, "mlp"),
                           devices=jax.devices()[:4], elastic="accumulate")
    with caplog.at_level(logging.WARNING, logger="parallax"):
        result = trainer.fit(train_data("mlp"), resume=True)
    assert trainer.config.step.grad_accum == 2
    assert "Global batch 32 kept: grad_accum 2 keeps 4 rows per data shard and microbatch." in caplog.text
    assert_same_training("mlp", uninterrupted, [h["loss"] for h in result.history.train],
                         jax.device_get(result.state.params))


def test_a_global_batch_that_cannot_be_kept_is_a_clear_error_before_anything_runs(uninterrupted, tmp_path):
    ckpt = copy_of(uninterrupted["mlp"][0], tmp_path, "mlp")
    trainer = make_trainer("mlp", px.FSDP(min_weight_size=64), ckpt, devices=jax.devices()[:3])
    with pytest.raises(ValueError, match=r"written on 8 devices .*this run has 3 devices \(3 data shards\), and its "
                                         r"global batch 32 \(grad_accum 1\) does not split over 3 data shards\. "
                                         r"Keep the batch .* divide 32; or .*batch_size= a multiple of 3"):
        trainer.fit(train_data("mlp"), resume=True)
    assert trainer.state is None and px.checkpoint.Checkpointer(ckpt).steps() == [3]  # nothing loaded or lost
    accumulating = make_trainer("mlp", px.FSDP(min_weight_size=64), ckpt, devices=jax.devices()[:3],
                                elastic="accumulate")
    with pytest.raises(ValueError, match=r"elastic='accumulate': .* 4 rows per data shard and microbatch; the global "
                                         r"batch 32 is not a whole number of such microbatches on 3 data shards"):
        accumulating.fit(train_data("mlp"), resume=True)
    with pytest.raises(ValueError, match=r"elastic='bogus'; use 'keep_batch' .* or 'accumulate'"):
        make_trainer("mlp", px.FSDP(), ckpt, elastic="bogus")
