"""Trainer.fit: resume, resharding, preemption, NaN guard, checkpoints, exact evaluation."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import jax
import ml_collections
import numpy as np
import optax
import pytest

import parallax as px
from parallax import CheckpointError
from tests.models import MLP, classifier_loss

pytestmark = pytest.mark.core

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "train_run.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(*args, expect=0):
    proc = subprocess.run([sys.executable, SCRIPT, *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == expect, proc.stderr[-3000:]
    return proc


# SIGKILL and resume (bitwise equal to an uninterrupted run): tests/test_faults.py, at seeded steps.


@pytest.mark.wide("a fault run: a signal to a training process of its own")
def test_sigterm_finishes_the_step_saves_and_exits_zero(tmp_path):
    proc = run_script(tmp_path / "ckpt", tmp_path / "out.npz", 20, "--sigterm-at", 5)
    # The signal lands while step 6 is in flight (step 5's metrics are read after step 6 is
    # dispatched): step 6 is finished and saved, nothing after it runs.
    assert sorted(int(s) for s in os.listdir(tmp_path / "ckpt")) == [3, 6]
    assert "Preempted (SIGTERM): saved step 6, exiting." in proc.stderr
    assert not (tmp_path / "out.npz").exists()  # exited before the end of fit


@pytest.mark.wide("a fault run: a signal to a training process of its own")
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_a_signal_during_a_metric_read_still_saves_the_step_it_stops_at(tmp_path, signame):
    # Step 8 is not a checkpoint step; the signal lands while step 7's metrics are read,
    # after step 8 was dispatched and its save check passed. Step 8 is saved all the same.
    flag = "--sigterm-at" if signame == "SIGTERM" else "--sigint-at"
    proc = run_script(tmp_path / "ckpt", tmp_path / "out.npz", 20, flag, 7)
    assert sorted(int(s) for s in os.listdir(tmp_path / "ckpt")) == [3, 6, 8]
    assert f"Preempted ({signame}): saved step 8, exiting." in proc.stderr


@pytest.mark.wide("a fault run: a signal to a training process of its own")
def test_a_signal_with_no_checkpoint_yet_saves_and_returns(tmp_path):
    proc = run_script(tmp_path / "ckpt", tmp_path / "out.npz", 20, "--sigterm-at", 1, "--every", 100, "--return")
    # Before: the loop stopped at step 2 with nothing on disk at all.
    assert sorted(int(s) for s in os.listdir(tmp_path / "ckpt")) == [2]
    assert "Preempted (SIGTERM): saved step 2, returning." in proc.stderr
    assert (tmp_path / "out.npz").exists()  # fit returned


@pytest.mark.wide("a fault run: a signal to a training process of its own")
def test_a_second_sigint_stops_at_once(tmp_path):
    proc = run_script(tmp_path / "ckpt", tmp_path / "out.npz", 20, "--sigint-twice-at", 4, expect=-signal.SIGINT)
    assert "KeyboardInterrupt" in proc.stderr and "second SIGINT" in proc.stderr
    assert not (tmp_path / "out.npz").exists()


def data(n=96, seed=0, nan_at=None):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 24)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    if nan_at is not None:
        x[nan_at] = np.nan
    return {"x": x, "y": y}


def make_trainer(strategy=None, **options):
    options.setdefault("progress", False)
    options.setdefault("batch_size", 16)
    # The loop, checkpoints and signals are under test here, not the compile path: one compile
    # per step, not two (the cost model's choice is tested in test_auto.py, test_per_example_proof.py).
    options.setdefault("compile", "jit")
    return px.Trainer(MLP(), optax.adam(1e-2), classifier_loss, strategy=strategy or px.FSDP(min_weight_size=0),
                      **options)


def test_checkpoint_from_fsdp8_restores_under_dp_and_fsdp4(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    first = make_trainer(max_steps=6, checkpoint_dir=ckpt, checkpoint_every=3, shuffle=False)
    saved = jax.device_get(first.fit(data()).state)
    for strategy, devices in ((px.DataParallel(), None), (px.FSDP(min_weight_size=0), jax.devices()[:4])):
        trainer = make_trainer(strategy, devices=devices, max_steps=9, checkpoint_dir=ckpt, shuffle=False)
        trainer.restore({k: v[:16] for k, v in data().items()})
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(trainer.state.params), saved.params)
        kernel = trainer.state.params["up"]["kernel"]
        assert kernel.sharding.mesh.size == (8 if devices is None else 4)
        assert kernel.sharding.spec == strategy.param_specs(saved.params, trainer.mesh)["up"]["kernel"]
        result = trainer.fit(data(), resume=True)
        assert int(result.state.step) == 9 and result.history.train[0]["step"] == 7
        ckpt_other = str(tmp_path / f"copy_{id(strategy)}")
        os.rename(ckpt + "/9", ckpt_other)  # leave step 6 newest for the next strategy


def test_nan_loss_stops_naming_the_step_and_keeps_the_last_good_checkpoint(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    trainer = make_trainer(max_steps=6, checkpoint_dir=ckpt, checkpoint_every=2, shuffle=False)
    with pytest.raises(px.NonFiniteLossError,
                       match=r"step 5: the loss is nan.*newest checkpoint that verifies, step 4 .* is kept"):
        trainer.fit(data(nan_at=4 * 16 + 3))  # a NaN example in the 5th batch
    trainer.checkpointer.wait()
    assert sorted(int(s) for s in os.listdir(ckpt) if s.isdigit()) == [2, 4]
    restored = make_trainer(max_steps=6, checkpoint_dir=ckpt)
    restored.restore({k: v[:16] for k, v in data().items()})
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(restored.state.params))


def test_nan_loss_can_skip_the_update():
    trainer = make_trainer(max_steps=6, shuffle=False, on_nonfinite="skip")
    result = trainer.fit(data(nan_at=4 * 16 + 3))
    assert [h["skipped"] for h in result.history.train] == [0, 0, 0, 0, 1, 0]
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(result.state.params))
    assert int(result.state.step) == 6


def test_mismatched_checkpoint_is_a_clear_error_and_is_not_deleted(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    make_trainer(max_steps=2, checkpoint_dir=ckpt).fit(data())
    before = sorted(os.listdir(ckpt))
    other = px.Trainer(MLP(hidden=32), optax.adam(1e-2), classifier_loss, strategy=px.FSDP(min_weight_size=0),
                       max_steps=4, batch_size=16, checkpoint_dir=ckpt, progress=False)
    with pytest.raises(CheckpointError, match=r"(?s)different model.*params/up/kernel is float32\(24, 64\) "
                                              r"in the checkpoint, float32\(24, 32\) here.*Nothing was deleted"):
        other.fit(data(), resume=True)
    assert sorted(os.listdir(ckpt)) == before


def test_corrupted_checkpoint_is_a_clear_error_and_is_not_deleted(tmp_path):
    ckpt = tmp_path / "ckpt"
    make_trainer(max_steps=2, checkpoint_dir=str(ckpt)).fit(data())
    for root, _, files in os.walk(ckpt / "2"):
        for name in files:
            with open(os.path.join(root, name), "wb") as stream:
                stream.write(b"\x00garbage")
    before = sorted(str(p) for p in ckpt.rglob("*"))
    with pytest.raises(CheckpointError,
                       match=r"(?s)No checkpoint in .* verifies:.*step 2 fails verification.*left in place"):
        make_trainer(max_steps=4, checkpoint_dir=str(ckpt)).fit(data(), resume=True)
    assert sorted(str(p) for p in ckpt.rglob("*")) == before


def test_existing_checkpoints_need_resume(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    make_trainer(max_steps=2, checkpoint_dir=ckpt).fit(data())
    with pytest.raises(ValueError, match=r"already holds checkpoints \(newest: step 2\).*resume=True"):
        make_trainer(max_steps=4, checkpoint_dir=ckpt).fit(data())


@pytest.mark.parametrize("strategy", [px.DataParallel(), px.combine(px.DataParallel(2), px.FSDP(4, min_weight_size=0))],
                         ids=["dp", "dp+fsdp"])
def test_evaluate_equals_one_device_over_the_whole_set_including_a_partial_batch(strategy):
    trainer = make_trainer(strategy, max_steps=3, eval_batch_size=16)
    trainer.fit(data())
    eval_set = data(n=53, seed=1)  # 3 full batches of 16 and a last one of 5
    metrics = trainer.evaluate(eval_set)
    variables = jax.device_get(trainer.state.variables)
    logits = np.asarray(MLP().apply(variables, eval_set["x"]))
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, eval_set["y"])
    np.testing.assert_allclose(metrics["loss"], float(np.mean(losses)), rtol=1e-6)
    np.testing.assert_allclose(metrics["accuracy"], float((logits.argmax(-1) == eval_set["y"]).mean()), rtol=1e-6)


def test_configdict_and_keywords(tmp_path):
    config = ml_collections.ConfigDict({"max_steps": 4, "batch_size": 16, "progress": False, "seed": 3})
    trainer = px.Trainer(MLP(), optax.sgd(0.1), classifier_loss, strategy=px.DataParallel(), config=config,
                         max_steps=5)
    assert trainer.config.max_steps == 5 and trainer.config.seed == 3
    assert len(trainer.fit(data()).history.train) == 5
    with pytest.raises(ValueError, match=r"Unknown Trainer option\(s\) \['max_step'\] \(did you mean 'max_steps'\?\)"):
        px.Trainer(MLP(), optax.sgd(0.1), classifier_loss, max_step=5)


def test_epochs_callbacks_and_logs(tmp_path):
    seen = []

    class Record:
        every = 2

        def on_step(self, info):
            seen.append((info.step, info.epoch, sorted(info.metrics)))

    schedule = optax.linear_schedule(1e-2, 0.0, 12)
    log_path = tmp_path / "log.jsonl"
    trainer = px.Trainer(MLP(), optax.adam(schedule), classifier_loss, strategy=px.FSDP(min_weight_size=0),
                         epochs=2, batch_size=16, eval_every=4, progress=False,
                         callbacks=[px.LearningRateLogger(schedule), Record(), px.JSONLogger(log_path, every=3),
                                    px.TensorBoardLogger(tmp_path / "tb", every=3)])
    result = trainer.fit(data(), eval_data=data(n=40, seed=2))
    assert int(result.state.step) == 12  # 96 examples / 16 = 6 steps per epoch
    assert [s for s, _, _ in seen] == [2, 4, 6, 8, 10, 12]
    assert [e for _, e, _ in seen] == [0, 0, 0, 1, 1, 1]
    assert seen[0][2] == ["accuracy", "learning_rate", "loss"]
    lines = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert [r["step"] for r in lines] == [3, 4, 6, 8, 9, 12]  # every 3, and every evaluation
    assert "eval" in lines[1] and lines[0]["train"]["learning_rate"] == pytest.approx(float(schedule(2)))
    assert any(name.startswith("events") for name in os.listdir(tmp_path / "tb"))
    assert [h["step"] for h in result.history.eval] == [4, 8, 12]


def test_early_stopping():
    trainer = px.Trainer(MLP(), optax.sgd(0.0), classifier_loss, strategy=px.DataParallel(), max_steps=50,
                         batch_size=16, eval_every=2, progress=False,
                         callbacks=[px.EarlyStopping(monitor="loss", patience=2)])
    result = trainer.fit(data(), eval_data=data(n=32, seed=3))
    assert result.stop_reason.startswith("early stopping") and int(result.state.step) == 6


def test_iterable_data_and_progress_output(capsys):
    batches = [{k: v[i:i + 16] for k, v in data().items()} for i in range(0, 96, 16)]
    trainer = px.Trainer(MLP(), optax.adam(1e-2), classifier_loss, strategy=px.FSDP(min_weight_size=0), epochs=2)
    result = trainer.fit(batches)
    assert int(result.state.step) == 12
    err = capsys.readouterr().err
    assert "step 12/12" in err and "it/s" in err and "loss=" in err
    assert err.splitlines()[0] == "step 0/12 compiling…" and "step 1/12 compiled in " in err


def test_progress_counts_speed_and_eta_after_the_compiling_step(monkeypatch):
    """Steps per second and the ETA leave out the first step, which compiles (10 s here)."""
    import io

    from parallax.train import callbacks

    clock = iter([0.0, 10.0, 10.5, 11.0])  # fit start; step 1 done (compiled); steps 2 and 3, 0.5 s each
    monkeypatch.setattr(callbacks.time, "perf_counter", lambda: next(clock))
    out = io.StringIO()
    bar = callbacks.ProgressBar(stream=out)
    bar.on_fit_start(type("T", (), {"start_step": 0, "max_steps": 5})())
    for step in (1, 2, 3):
        bar.on_step(callbacks.StepInfo(step=step, epoch=0, metrics={"loss": 1.0}, eval_metrics=None, max_steps=5,
                                       trainer=None, state=None))
    lines = out.getvalue().splitlines()
    assert lines[:2] == ["step 0/5 compiling…", "step 1/5 compiled in 10.0s loss=1"], lines
    assert lines[-1].startswith("step 3/5 2.00 it/s eta 1s"), lines  # not 3 steps / 11 s


@pytest.mark.parametrize("kind", ["file", "unwritable"])
def test_a_checkpoint_dir_that_cannot_be_written_fails_before_step_one(tmp_path, kind):
    if kind == "file":
        path = tmp_path / "ckpt"
        path.write_text("not a directory")
        expected = r"is an existing file, not a directory"
    elif os.geteuid() == 0:  # root writes through permission bits: use a filesystem nobody writes to
        path = "/sys/parallax-test/ckpt"
        expected = r"/sys/parallax-test/ckpt is not writable \(/sys: Permission denied\)"
    else:
        (tmp_path / "ro").mkdir(mode=0o500)
        path = tmp_path / "ro" / "ckpt"
        expected = r"is not writable"
    trainer = make_trainer(max_steps=4, checkpoint_dir=str(path))
    with pytest.raises(ValueError, match=expected):
        trainer.fit(data())
    assert trainer.history.train == [] and trainer.state is None  # nothing ran


def test_nothing_is_created_on_disk_until_a_checkpoint_is_due(tmp_path):
    path = tmp_path / "run" / "ckpt"
    trainer = make_trainer(max_steps=2, checkpoint_dir=str(path))
    assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError):
        trainer.fit({"x": data()["x"][:8], "y": data()["y"][:8]})  # fewer examples than one batch
    assert not (tmp_path / "run").exists()
    trainer.fit(data())
    assert sorted(os.listdir(path)) == ["2"]


def test_eval_data_that_does_not_fit_the_model_fails_before_step_one(tmp_path):
    trainer = make_trainer(max_steps=4, eval_every=2, checkpoint_dir=str(tmp_path / "ckpt"))
    wrong = {"x": data()["x"][:, :20], "y": data()["y"]}  # 20 features, the model was built for 24
    with pytest.raises(ValueError, match=r"eval_data does not fit the model.*float32\(16, 20\).*before training"):
        trainer.fit(data(), eval_data=wrong)
    assert trainer.history.train == [] and not (tmp_path / "ckpt").exists()


def test_an_error_during_evaluation_leaves_the_newest_state_checkpointed(tmp_path):
    good = {k: v[:16] for k, v in data().items()}
    bad = {"x": data()["x"][:16, :20], "y": data()["y"][:16]}  # only the second eval batch is wrong
    trainer = make_trainer(max_steps=6, eval_every=3, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=100)
    with pytest.raises(Exception):  # noqa: B017 (whatever flax/jax raise)
        trainer.fit(data(), eval_data=[good, bad])
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["3"]  # saved at the failing evaluation's step


def test_resuming_with_another_batch_size_continues_at_the_same_example(tmp_path, caplog):
    ckpt = str(tmp_path / "ckpt")
    make_trainer(max_steps=3, batch_size=16, checkpoint_dir=ckpt, shuffle=False).fit(data())  # 48 examples seen
    trainer = make_trainer(max_steps=5, batch_size=24, checkpoint_dir=ckpt, shuffle=False)
    seen = []

    class Record:
        every = 1

        def on_step(self, info):
            seen.append(info.step)

    trainer.callbacks.append(Record())
    with caplog.at_level("WARNING", logger="parallax"):
        result = trainer.fit(data(), resume=True)
    assert "batch_size=24 instead of 16: continuing at example 48 of epoch 0 (batch 2)" in caplog.text
    assert seen == [4, 5] and int(result.state.step) == 5
    # Batches 2 and 3 of 24 (examples 48-95) were trained on; the next resume starts at batch 4.
    metadata = px.checkpoint.Checkpointer(ckpt).read_metadata(5)
    assert (metadata["position"], metadata["batch_size"], metadata["examples"]) == (4, 24, 96)


def test_resuming_with_a_batch_size_that_cannot_continue_says_what_to_do(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    make_trainer(max_steps=3, batch_size=16, checkpoint_dir=ckpt).fit(data())  # 48 examples seen
    with pytest.raises(ValueError, match=r"batch_size=16 after 48 examples of epoch 0; batch_size=40 does not "
                                         r"divide 48.*Resume with batch_size=16, or one that divides 48 \(e\.g\. 48"):
        make_trainer(max_steps=5, batch_size=40, checkpoint_dir=ckpt).fit(data(), resume=True)


@pytest.mark.parametrize("damage", ["flip one bit", "truncate", "delete a file"])
def test_a_damaged_checkpoint_is_never_used_and_resume_falls_back_to_one_that_verifies(tmp_path, caplog, damage):
    ckpt = tmp_path / "ckpt"
    make_trainer(max_steps=4, checkpoint_dir=str(ckpt), checkpoint_every=2, shuffle=False).fit(data())
    reference = make_trainer(max_steps=4, shuffle=False, checkpoint_dir=str(tmp_path / "other"),
                             checkpoint_every=2)
    reference.fit(data())
    # Damage the biggest array file of step 4 the way disks and copies do.
    files = [p for p in (ckpt / "4").rglob("*") if p.is_file() and p.name != "parallax_checksums.json"]
    victim = max(files, key=lambda p: p.stat().st_size)
    raw = bytearray(victim.read_bytes())
    if damage == "flip one bit":
        raw[len(raw) // 2] ^= 0x01
        victim.write_bytes(bytes(raw))
    elif damage == "truncate":
        victim.write_bytes(bytes(raw[: len(raw) // 2]))
    else:
        victim.unlink()
    before = sorted(str(p) for p in ckpt.rglob("*"))
    with pytest.raises(CheckpointError, match=r"step 4 .* is damaged: .*left in place"):
        make_trainer(max_steps=6, checkpoint_dir=str(ckpt)).restore({k: v[:16] for k, v in data().items()}, 4)
    trainer = make_trainer(max_steps=6, checkpoint_dir=str(ckpt), shuffle=False)
    with caplog.at_level("WARNING", logger="parallax"):
        result = trainer.fit(data(), resume=True)
    assert "step 4 fails verification" in caplog.text and result.history.train[0]["step"] == 3
    assert str(ckpt / "4") in before and (ckpt / "4").exists()  # left in place
    # Resumed from step 2 (verified): steps 3-6 equal an uninterrupted run's.
    straight = make_trainer(max_steps=6, shuffle=False).fit(data())
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(result.state.params),
                 jax.device_get(straight.state.params))


def test_a_checkpoint_from_another_optimizer_says_so(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    make_trainer(max_steps=2, checkpoint_dir=ckpt).fit(data())  # adam
    other = px.Trainer(MLP(), optax.adamw(1e-2), classifier_loss, strategy=px.FSDP(min_weight_size=0), max_steps=4,
                       batch_size=16, checkpoint_dir=ckpt, progress=False)
    with pytest.raises(CheckpointError) as raised:
        other.fit(data(), resume=True)
    message = str(raised.value)
    assert ("saved with another optimizer: the checkpoint's optimizer state is ScaleByAdamState, EmptyState; this "
            "run's is ScaleByAdamState, EmptyState, EmptyState (EmptyState: a stateless step") in message, message
    assert "Nothing was deleted" in message and "PyTreeDef" not in message and "CustomNode" not in message
    momentum = px.Trainer(MLP(), optax.sgd(1e-2, momentum=0.9), classifier_loss, strategy=px.DataParallel(),
                          max_steps=4, batch_size=16, checkpoint_dir=ckpt, progress=False)
    with pytest.raises(CheckpointError, match="optimizer state is ScaleByAdamState, EmptyState; this run's is "
                                              "TraceState, EmptyState"):
        momentum.fit(data(), resume=True)


def test_a_disk_without_room_for_one_checkpoint_fails_before_step_one(tmp_path, monkeypatch):
    import collections

    from parallax import checkpoint

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: usage(2**30, 2**30 - 1024, 1024))
    trainer = make_trainer(max_steps=2, checkpoint_dir=str(tmp_path / "ckpt"))
    with pytest.raises(ValueError, match=r"has 0.0 MiB free, but one checkpoint of this train state takes about"):
        trainer.fit(data())
    assert trainer.state is None and not (tmp_path / "ckpt").exists()
