"""Real data: every kind of iterable and Grain form, their resume, prefetch, and the data errors.

References are a plain one-device optax loop over the same batches (no batch lost, none
repeated) and the uninterrupted run (a resumed run ends bitwise equal to it). Reads are
counted in a wrapped random-access source (``tests/scripts/grain_run.py``), worker
processes included, so a resume is seen to read nothing it already trained on.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import json
import logging
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time

import grain
import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import parallax as px
from tests.environment import child_env
from tests.models import MLP, batches, classifier_loss
from tests.reference import TOL, max_diff, run_plain

pytestmark = pytest.mark.core

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "grain_run.py")
_spec = importlib.util.spec_from_file_location("grain_run", SCRIPT)
grain_run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(grain_run)

STEPS = 5
BATCHES = batches("mlp", STEPS, 16)
EXAMPLES = [{k: v[i] for k, v in batch.items()} for batch in BATCHES for i in range(16)]
STRATEGY = px.FSDP(min_weight_size=0, split="largest")


class Stateful:
    """An iterable whose iterator saves its position: the protocol parallax checkpoints."""

    def __init__(self, items):
        self.items = items

    def __iter__(self):
        return StatefulIterator(self.items)


class StatefulIterator:
    def __init__(self, items):
        self.items, self.index = items, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.index == len(self.items):
            raise StopIteration
        self.index += 1
        return self.items[self.index - 1]

    def get_state(self):
        return {"index": self.index}

    def set_state(self, state):
        self.index = state["index"]


def _loader():
    return grain.DataLoader(data_source=EXAMPLES, operations=[grain.transforms.Batch(16, drop_remainder=True)],
                            sampler=grain.samplers.IndexSampler(len(EXAMPLES), num_epochs=1, shuffle=False, seed=0))


FORMS = {
    "list": lambda: list(BATCHES),
    "generator": lambda: (batch for batch in BATCHES),  # one-shot: its first batch was lost before
    "generator function": lambda: (lambda: (batch for batch in BATCHES)),
    "get_state/set_state iterable": lambda: Stateful(BATCHES),
    "grain.MapDataset, batch_size=": lambda: grain.MapDataset.source(EXAMPLES),
    "grain.IterDataset, batched": lambda: grain.MapDataset.source(EXAMPLES).batch(16).to_iter_dataset(),
    "grain.DataLoader, batched": _loader,
}


@pytest.fixture(scope="module")
def trainer():
    """One trainer (its step compiled once); each fit starts from the same initial state."""
    return px.Trainer(MLP(), optax.adam(1e-2), classifier_loss, strategy=STRATEGY, max_steps=STEPS, batch_size=16,
                      shuffle=False, progress=False)


@pytest.fixture(scope="module")
def reference():
    state = px.init_state(MLP(), optax.adam(1e-2), BATCHES[0], strategy=STRATEGY, loss_fn=classifier_loss)
    return run_plain(MLP(), optax.adam(1e-2), classifier_loss, state, BATCHES)


@pytest.mark.parametrize("form", list(FORMS))
def test_every_kind_of_data_trains_on_every_batch_like_one_device(trainer, reference, form):
    state, history = trainer.fit(FORMS[form]())
    losses = np.array([row["loss"] for row in history.train[-STEPS:]])  # the trainer's history spans its fits
    assert len(losses) == STEPS and np.abs(losses - reference.losses).max() <= TOL, (form, losses, reference.losses)
    assert max_diff(jax.device_get(state.params), reference.params) <= TOL


def test_prefetch_depths_train_the_same(trainer):
    runs = []
    for depth in (0, 1, 4):
        trainer.config = dataclasses.replace(trainer.config, prefetch=depth)
        runs.append(jax.device_get(trainer.fit(list(BATCHES)).state.params))
    for params in runs[1:]:
        assert max_diff(params, runs[0]) == 0.0
    with pytest.raises(ValueError, match=r"prefetch=-1; use the number of batches to place ahead"):
        px.Trainer(MLP(), optax.adam(1e-2), classifier_loss, prefetch=-1)


@pytest.fixture(scope="module")
def map_straight(tmp_path_factory):
    """The uninterrupted 10-step run on a grain.MapDataset, in this process on 8 devices."""
    out = tmp_path_factory.mktemp("map-straight")
    return grain_run.run(grain_run.parse([str(out), "--form", "map", "--steps", "10"]))


def test_a_map_dataset_resumes_at_its_position_reading_nothing_again(tmp_path, caplog, map_straight):
    out = tmp_path / "resumed"
    out.mkdir()
    grain_run.run(grain_run.parse([str(out), "--form", "map", "--steps", "5"]))
    for name in glob.glob(str(out / "reads-*.txt")):
        os.rename(name, name + ".before")
    resumed = grain_run.run(grain_run.parse([str(out), "--form", "map", "--steps", "10", "--resume"]))
    assert max_diff(jax.device_get(resumed.state.params), jax.device_get(map_straight.state.params)) == 0.0
    trained = [i for batch in grain_run.order("map")[5:10] for i in batch]
    probe = [0]  # MapData reads example 0 once, for the batch's shapes
    assert sorted(_reads(out)) == sorted(trained + probe), "a resumed MapDataset reads only the batches it trains on"
    # A plain iterable keeps skipping ahead, and says so.
    ckpt = str(tmp_path / "plain")
    px.Trainer(MLP(), optax.sgd(0.1), classifier_loss, max_steps=3, progress=False, checkpoint_dir=ckpt).fit(BATCHES)
    with caplog.at_level(logging.WARNING, logger="parallax"):
        result = px.Trainer(MLP(), optax.sgd(0.1), classifier_loss, max_steps=STEPS, progress=False,
                            checkpoint_dir=ckpt).fit(BATCHES, resume=True)
    assert "Resuming an iterable (it keeps no state): re-reading and skipping the 3 batches" in caplog.text
    assert [row["step"] for row in result.history.train] == [4, 5]


def _reads(out) -> list[int]:
    return [int(line) for name in glob.glob(str(out / "reads-*.txt")) for line in open(name)]


@pytest.mark.wide("a fault run: SIGKILL and resume in processes of their own")
def test_a_grain_pipeline_with_workers_killed_by_sigkill_resumes_bitwise_reading_nothing_twice(tmp_path):
    kill_at = random.Random(os.environ.get("PYTEST_XDIST_WORKER", "")).randint(3, 7)
    out = tmp_path / "run"
    out.mkdir()
    command = [sys.executable, SCRIPT, str(out), "--form", "iter", "--workers", "2", "--steps", "10"]
    code, output = _run(command + ["--sigkill-at", str(kill_at)], out / "killed.log")
    assert code == -signal.SIGKILL, output[-3000:]
    saved = max(int(name) for name in os.listdir(out / "ckpt") if name.isdigit())
    assert saved == kill_at - 1, (saved, kill_at)  # step kill_at's checkpoint is written after its metrics
    before = _reads(out)
    for name in glob.glob(str(out / "reads-*.txt")):
        os.remove(name)
    code, output = _run(command + ["--resume"], out / "resumed.log")
    assert code == 0, output[-3000:]
    # The uninterrupted run, here (no workers: Grain's order does not depend on them).
    straight_dir = tmp_path / "straight"
    straight_dir.mkdir()
    straight = grain_run.run(grain_run.parse([str(straight_dir), "--form", "iter", "--steps", "10"]))
    with open(out / "result0.json") as f:
        losses = {int(k): v for k, v in json.load(f)["losses"].items()}
    assert sorted(losses) == list(range(saved + 1, 11))
    assert all(losses[step] == row["loss"] for row in straight.history.train if (step := row["step"]) in losses)
    params = dict(np.load(out / "params.npz"))
    expected = jax.tree_util.tree_flatten_with_path(jax.device_get(straight.state.params))[0]
    assert all(np.array_equal(params[jax.tree_util.keystr(p)], v) for p, v in expected), "not bitwise"
    # Reads: the resumed run read no example of a batch trained before its checkpoint, none twice.
    order = grain_run.order("iter")
    after = _reads(out)
    trained_before = {i for batch in order[:saved] for i in batch}
    assert not trained_before & set(after) and len(after) == len(set(after)), (saved, sorted(after))
    assert {i for batch in order[saved:10] for i in batch} <= set(after)
    assert {i for batch in order[:saved] for i in batch} <= set(before)


def _run(command, log, timeout=300) -> tuple[int, str]:
    """Runs ``command`` in its own process group; afterwards nothing of the group is left
    (a SIGKILLed run's Grain workers live on: ``python -m parallax.launch`` ends them the same way)."""
    with open(log, "w") as stream:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=stream, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        finally:
            _end_group(proc)
    return code, open(log).read()


def _end_group(proc) -> None:
    """SIGKILLs what is left of ``proc``'s process group and waits until none of it runs."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    for _ in range(200):
        if not _running_in_group(proc.pid):
            return
        time.sleep(0.05)
    raise AssertionError(f"process group {proc.pid} outlived 10 s after SIGKILL")


def _running_in_group(group: int) -> list[int]:
    """The processes of ``group`` that are not zombies (this machine's init may not reap them)."""
    running = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            running.append(int(entry))
    return running


@pytest.mark.wide("fault runs: Grain's worker processes at a raise and a preemption")
def test_grain_workers_end_with_fit_when_it_ends_raises_or_is_preempted():
    def pipeline():
        return (grain.MapDataset.source(EXAMPLES).batch(16).to_iter_dataset()
                .mp_prefetch(grain.MultiprocessingOptions(num_workers=1)))

    trainer = px.Trainer(MLP(), optax.sgd(0.1), classifier_loss, strategy=STRATEGY, max_steps=3, progress=False)
    trainer.fit(pipeline())
    assert multiprocessing.active_children() == []
    with pytest.raises(ValueError, match="yields batches of 16 examples"):  # refused before step one
        px.Trainer(MLP(), optax.sgd(0.1), classifier_loss, max_steps=3, batch_size=32, progress=False).fit(pipeline())
    assert multiprocessing.active_children() == []

    class Boom:
        def on_step(self, info):
            raise RuntimeError("boom")

    failing = px.Trainer(MLP(), optax.sgd(0.1), classifier_loss, strategy=STRATEGY, max_steps=3, progress=False,
                         callbacks=[Boom()])
    with pytest.raises(RuntimeError, match="boom"):
        failing.fit(pipeline())
    assert multiprocessing.active_children() == []

    class Preempt:  # SIGTERM's handler, as the signal would call it at step 2
        def on_step(self, info):
            if info.step == 2:
                info.trainer._preemption._handler(signal.SIGTERM, None)

    preempted = px.Trainer(MLP(), optax.sgd(0.1), classifier_loss, strategy=STRATEGY, max_steps=3, progress=False,
                           callbacks=[Preempt()], on_preemption="return", fetch_every=1)
    assert preempted.fit(pipeline()).stop_reason == "preempted"
    assert multiprocessing.active_children() == []


def test_data_in_a_shape_parallax_cannot_use_is_named_with_the_fix():
    trainer = px.Trainer(MLP(), optax.sgd(0.1), classifier_loss, max_steps=2, progress=False, batch_size=16)
    unbatched = grain.MapDataset.source(EXAMPLES).to_iter_dataset()
    with pytest.raises(ValueError, match=r"\(a grain.IterDataset\) yields single examples.*Batch it in Grain"):
        trainer.fit(unbatched)
    loader = grain.DataLoader(data_source=EXAMPLES, sampler=grain.samplers.IndexSampler(len(EXAMPLES), num_epochs=1))
    with pytest.raises(ValueError, match=r"\(a grain.DataLoader\) yields single examples.*grain.transforms.Batch"):
        trainer.fit(loader)
    with pytest.raises(ValueError, match=r"yields batches of 8 examples, where parallax reads each element as a "
                                         r"batch of batch_size=16"):
        trainer.fit(grain.MapDataset.source(EXAMPLES).batch(8).to_iter_dataset())
    no_size = px.Trainer(MLP(), optax.sgd(0.1), classifier_loss, max_steps=2, progress=False)
    with pytest.raises(ValueError, match=r"A grain.MapDataset is read as single examples.*pass batch_size="):
        no_size.fit(grain.MapDataset.source(EXAMPLES))
    with pytest.raises(ValueError, match=r"is a list of 80 per-example dicts \({'x', 'y'}\)"):  # array leaves
        no_size.fit(EXAMPLES)
    lists = [EXAMPLES[i:i + 16] for i in range(0, 80, 16)]
    with pytest.raises(ValueError, match=r"is a Python list of 16 dicts, where parallax reads a batch.*np.stack"):
        no_size.fit(lists)
    # A batch placed on another mesh, given to a step after its first call (JAX's jit refused it).
    state = px.init_state(MLP(), optax.sgd(0.1), BATCHES[0], strategy=STRATEGY, loss_fn=classifier_loss)
    step = px.make_train_step(classifier_loss, STRATEGY)
    state, _ = step(state, BATCHES[0])
    elsewhere = jax.make_mesh((4,), ("fsdp",), devices=jax.devices()[4:])
    with pytest.raises(ValueError, match=r"batch\['x'\] is placed on a mesh with axes \{'fsdp': 4\}, other devices "
                                         r"than the state's mesh \{'fsdp': 8\}. Pass host \(numpy\) arrays"):
        step(state, jax.device_put(BATCHES[1], NamedSharding(elsewhere, P("fsdp"))))


@pytest.mark.wide("a launch of several processes")
@pytest.mark.launch
def test_two_processes_read_disjoint_shares_and_their_checkpoint_resumes_in_one_on_fewer_devices(
        tmp_path, map_straight):
    out = tmp_path / "two"
    out.mkdir()
    env = child_env()
    proc = subprocess.run([sys.executable, "-m", "parallax.launch", "--processes", "2", "--devices-per-process", "4",
                           "--timeout", "240", SCRIPT, str(out), "--form", "map", "--steps", "6"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    straight = {row["step"]: row["loss"] for row in map_straight.history.train}
    for index in (0, 1):
        with open(out / f"result{index}.json") as f:
            losses = json.load(f)["losses"]
        assert max(abs(loss - straight[int(step)]) for step, loss in losses.items()) <= TOL
    shares = [[int(line) for line in open(name)] for name in sorted(glob.glob(str(out / "reads-*.txt")))]  # noqa: SIM115 (read in a comprehension)
    assert len(shares) == 2
    shares = [sorted(share)[1:] if 0 in share else share for share in shares]  # each read example 0 for shapes
    trained = sorted(i for batch in grain_run.order("map")[:6] for i in batch)
    assert not set(shares[0]) & set(shares[1]) and sorted(shares[0] + shares[1]) == trained
    # Their checkpoint (step 6), resumed here in one process on 4 devices: the same global batches, in order.
    resumed = grain_run.run(grain_run.parse([str(out), "--form", "map", "--steps", "10", "--resume", "--devices", "4"]))
    assert [row["step"] for row in resumed.history.train] == [7, 8, 9, 10]
    assert max(abs(row["loss"] - straight[row["step"]]) for row in resumed.history.train) <= TOL
    assert max_diff(jax.device_get(resumed.state.params), jax.device_get(map_straight.state.params)) <= TOL


def test_evaluate_reads_grain_datasets_like_arrays(trainer):
    arrays = {k: np.concatenate([b[k] for b in BATCHES])[:72] for k in BATCHES[0]}  # a last partial batch of 8
    if trainer.state is None:
        trainer.fit(list(BATCHES))
    trainer.config = dataclasses.replace(trainer.config, eval_batch_size=32)
    expected = trainer.evaluate(arrays)
    assert trainer.evaluate(grain.MapDataset.source(EXAMPLES[:72])) == expected
    batched = grain.MapDataset.source(EXAMPLES[:72]).batch(32).to_iter_dataset()
    got = trainer.evaluate(batched)
    assert got.keys() == expected.keys() and all(abs(got[k] - expected[k]) <= 1e-6 for k in got)


def test_an_iterator_state_saved_by_other_processes_is_refused_by_name():
    from parallax.train.feed import saved_state

    record = {"data": {"processes": 2, "states": [{"epoch": 0, "iterator": {"json": {}}}] * 2}}
    with pytest.raises(ValueError, match=r"position in each of 2 processes; this run has 1.*resume on 2 processes, "
                                         r"or train from a grain.MapDataset with batch_size="):
        saved_state(record)
    assert saved_state({}) is None
