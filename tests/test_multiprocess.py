"""Several processes, through the launcher: 2 processes x 4 CPU devices against 1 x 8 here.

Each launch (``python -m parallax.launch``, real ``jax.distributed`` processes on 127.0.0.1
with a hard timeout) runs ``tests/scripts/multiprocess_run.py``; the references are the same
runs trained in this process on 8 devices. Launches are expensive on 2 cores, so each checks
several things:

* A: FSDP, process 1 alone gets SIGTERM, process 1 starts with a warm (made-up) cache of
  device speeds and process 0 with none, progress printed;
* B: resumes A's checkpoint in 2 processes; SIGTERM to process 0, then to process 1 three
  steps later; then this process resumes B's checkpoint and trains to the end;
* C: DPxFSDP, the eval set given as each process's parts (the last batch split 2 and 3
  rows), process 1 raises at step 7;
* D: resumes a checkpoint written here (1 process) in 2 processes that keep the optimizer
  state and params in host memory (offload); process 1 is SIGKILLed after step 6's checkpoint
  committed; this process resumes that checkpoint (without offload) to the end
  (one process killed the same way: ``tests/test_faults.py``, whose SIGKILL runs no longer
  wait for the checksums before the kill);
* E: process 1's batches are one token shorter: an error before anything compiles;
* F: process 1 has 2 devices, process 0 has 4: an error from ``px.distributed.initialize``;
* G: Ctrl-C to the launcher, once training prints: passed on to both processes, which stop
  at one step and save it;
* H: every layout of the batch over the processes in one launch (``tests/scripts/layouts_run.py``):
  DP, FSDP, TP, their 2-axis combinations in either order and user meshes, on array data (each
  process reads the rows its devices hold) and on iterables (where their parts fit; an error
  naming the layout where not); parallax's meshes laid out over the two processes as ``px.plan``
  measures two simulated hosts, a user's mesh whose tensor axis crosses them warned about;
* I: scripts that call ``jax.distributed.initialize`` themselves (``tests/scripts/own_init_run.py``),
  through the launcher and started by hand: data of unknown length that ends on one process
  first, a raise at a step, a SIGKILL (four launches at once).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import optax
import pytest

import parallax as px
from parallax.launch import _free_port
from parallax.train.checkpoint import Checkpointer
from tests.environment import child_env
from tests.models import MLP, StackedMLP, classifier_loss

pytestmark = [pytest.mark.wide("launches of several processes (each 30-150 s cold on two cores)"), pytest.mark.launch]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "multiprocess_run.py")
STEPS = 16
TOL = 1e-5
SLOW = ("--slow", "0.3")  # a step time long enough for JAX's preemption notifier (it looks once a second)

LAYOUTS = os.path.join(ROOT, "tests", "scripts", "layouts_run.py")
OWN_INIT = os.path.join(ROOT, "tests", "scripts", "own_init_run.py")


def _script(path):
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


multiprocess_run, layouts_run = _script(SCRIPT), _script(LAYOUTS)


def launch(out, *args, processes=2, devices=4, timeout=240, script=SCRIPT):
    """Runs the script under the launcher; returns (completed process, when it returned)."""
    os.makedirs(out, exist_ok=True)
    env = child_env()
    command = [sys.executable, "-m", "parallax.launch", "--processes", str(processes), "--devices-per-process",
               str(devices), "--timeout", str(timeout), script, str(out), *map(str, args)]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout + 60)
    return proc, time.time()


def here(out, *args):
    """The same run in this process, on its 8 devices."""
    os.makedirs(out, exist_ok=True)
    return multiprocess_run.run(multiprocess_run.parse([str(out), *map(str, args)]))


def results(out, processes=2):
    return [json.load(open(os.path.join(out, f"result{i}.json"))) for i in range(processes)]


def logged(out):
    """Process 0's JSONL log: {step: train loss}, {step: eval loss}."""
    with open(os.path.join(out, "log.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return ({r["step"]: r["train"]["loss"] for r in records},
            {r["step"]: r["eval"]["loss"] for r in records if "eval" in r})


def assert_losses(losses, reference, steps):
    diff = max(abs(losses[s] - reference[s - 1]) for s in steps)
    assert diff <= TOL, (diff, {s: (losses[s], reference[s - 1]) for s in steps})
    return diff


def assert_no_process_left(out):
    found = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    assert not found, f"processes left behind: {found}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted 1 x 8 runs: {strategy: (train losses by step - 1, {step: eval loss})}."""
    out = {}
    for name in ("fsdp", "dp+fsdp"):
        record = here(tmp_path_factory.mktemp(name.replace("+", "_")), "--strategy", name, "--steps", STEPS)
        out[name] = ([r["loss"] for r in record["train"]], {r["step"]: r["loss"] for r in record["eval"]})
    return out


@pytest.mark.budget(100, "three launches of 2 processes whose steps are slowed to 0.3 s for JAX's preemption "
                         "notifier, and the same runs here")
def test_preempted_by_one_process_then_two_signals_apart_stops_all_at_one_step_and_resumes_exactly(
        reference, tmp_path, caplog):
    losses, evals = reference["fsdp"]
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    proc, _ = launch(a, "--steps", STEPS, "--signal", "1:3", *SLOW, "--warm-cache", 1, "--progress")
    assert proc.returncode == 0, proc.stdout[-4000:]
    first = results(a)
    stop = first[0]["step"]
    assert {r["stop_reason"] for r in first} == {"preempted"} and {r["step"] for r in first} == {stop} and stop < STEPS
    assert first[0]["checkpoints"][-1] == stop and first[1]["checkpoints"] == first[0]["checkpoints"]
    assert first[0]["signals"] == [] and first[1]["signals"] == [3]  # one process signalled
    # Process 1 had a warm cache of made-up device speeds, process 0 none: both used process 0's.
    assert first[0]["compile"] == first[1]["compile"] is not None
    assert os.path.exists(a / "cache0" / "device_speeds.json")
    # Only process 0 printed the summary and the progress.
    lines = proc.stdout.splitlines()
    assert any(line.startswith("[0] step ") for line in lines) and any("lint:" in line for line in lines)
    assert not [line for line in lines if line.startswith("[1]") and ("step " in line[:9] or "lint:" in line
                                                                       or "per device" in line)]
    train, evaluated = logged(a)
    assert_losses(train, losses, range(1, stop + 1))
    assert evaluated and max(abs(evaluated[s] - evals[s]) for s in evaluated) <= TOL  # 37 eval rows: exact

    # B: the checkpoint written by 2 processes resumes in 2; signals to each process three steps apart.
    shutil.copytree(a / "ckpt", b / "ckpt")
    proc, _ = launch(b, "--steps", STEPS, "--resume", "--signal", f"0:{stop + 1}", "--signal", f"1:{stop + 4}", *SLOW)
    assert proc.returncode == 0, proc.stdout[-4000:]
    second = results(b)
    again = second[0]["step"]
    assert {r["stop_reason"] for r in second} == {"preempted"} and {r["step"] for r in second} == {again}
    assert second[0]["start"] == stop < again < STEPS and second[0]["checkpoints"][-1] == again
    # Process 1's signal came later: before the agreed step, or after it as training ended.
    assert second[0]["signals"] == [stop + 1] and second[1]["signals"] in ([stop + 4], ["end"])
    train, _ = logged(b)
    assert_losses(train, losses, range(stop + 1, again + 1))

    # The checkpoint written by 2 processes resumes in 1 and trains to the same end.
    shutil.copytree(b / "ckpt", c / "ckpt")
    with caplog.at_level(logging.WARNING, logger="parallax"):
        last = here(c, "--steps", STEPS, "--resume")
    assert last["start"] == again and last["stop_reason"] == "max_steps"
    assert "unverified" not in caplog.text
    assert_losses({r["step"]: r["loss"] for r in last["train"]}, losses, range(again + 1, STEPS + 1))
    assert abs(last["eval"][-1]["loss"] - evals[STEPS]) <= TOL


def test_a_process_that_raises_ends_the_launch_within_seconds_naming_it(reference, tmp_path):
    losses, evals = reference["dp+fsdp"]
    proc, returned = launch(tmp_path, "--strategy", "dp+fsdp", "--steps", STEPS, "--raise", "1:7", "--iterable-eval")
    with open(tmp_path / "raised.json") as f:
        raised = json.load(f)
    assert proc.returncode == 1, proc.stdout[-4000:]
    assert returned - raised["time"] < 10, returned - raised["time"]
    assert "[launch] process 1 exited with code 1" in proc.stdout
    assert proc.stdout.count("RuntimeError: injected failure in process 1 at step 7") == 1
    assert_no_process_left(tmp_path)
    train, evaluated = logged(tmp_path)
    assert_losses(train, losses, range(1, 6))  # DP x FSDP over 2 processes trains as 1 x 8
    # The parts of every eval batch, the uneven last one gathered whole, give the one-process losses.
    assert {2, 4} <= set(evaluated) and max(abs(evaluated[s] - evals[s]) for s in evaluated) <= TOL
    checkpointer = Checkpointer(tmp_path / "ckpt")
    assert checkpointer.verify(checkpointer.latest_step()) is None  # what was committed stays intact


@pytest.mark.budget(60, "a checkpoint written here, a launch of 2 processes with host offload killed after a commit, "
                        "and the resume here")
def test_written_by_one_resumed_by_two_then_sigkilled_after_a_commit_resumes_verified(reference, tmp_path, caplog):
    losses, _ = reference["fsdp"]
    here(tmp_path, "--steps", 4)
    # The two processes keep the optimizer state and params in host memory; the checkpoint they
    # write from there resumes here with all state on the devices.
    proc, _ = launch(tmp_path, "--steps", STEPS, "--resume", "--sigkill", "1:7", "--offload", "optimizer+params")
    assert proc.returncode == 128 + 9, proc.stdout[-4000:]
    assert [json.load(open(tmp_path / f"memory{i}.json")) for i in range(2)] == [["pinned_host"]] * 2  # noqa: SIM115 (read in a comprehension)
    assert "[launch] process 1 was killed by SIGKILL" in proc.stdout
    assert_no_process_left(tmp_path)
    train, _ = logged(tmp_path)
    assert_losses(train, losses, range(5, 7))  # the 1-process checkpoint continues alike in 2
    checkpointer = Checkpointer(tmp_path / "ckpt")
    assert checkpointer.latest_step() == 6 and checkpointer.verify(6) is None  # recorded as it committed
    with caplog.at_level(logging.WARNING, logger="parallax"):
        last = here(tmp_path, "--steps", STEPS, "--resume")
    assert last["start"] == 6 and "unverified" not in caplog.text
    assert_losses({r["step"]: r["loss"] for r in last["train"]}, losses, range(7, STEPS + 1))


def test_processes_whose_batches_differ_fail_at_the_first_batch_naming_both(tmp_path):
    proc, _ = launch(tmp_path, "--steps", STEPS, "--short-rows", 1)
    assert proc.returncode == 1, proc.stdout[-4000:]
    assert ("The first training batch (each process's part) differs between processes: process 0 has "
            "{\"['x']\": \"int32(8, 9)\"}, process 1 has {\"['x']\": \"int32(8, 8)\"}"
            in proc.stdout), proc.stdout[-3000:]
    assert not os.path.exists(tmp_path / "ckpt")  # before anything ran


def test_processes_with_different_device_counts_fail_at_initialize_naming_both(tmp_path):
    script = tmp_path / "devices.py"
    script.write_text("import os\n"
                      "if os.environ['PARALLAX_PROCESS_ID'] == '1':\n"
                      "    os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=2'\n"
                      "import parallax as px\n"
                      "px.distributed.initialize()\n")
    proc = subprocess.run([sys.executable, "-m", "parallax.launch", "--processes", "2", "--devices-per-process", "4",
                           "--timeout", "120", str(script)], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1, proc.stdout[-3000:]
    for index in (0, 1):
        assert (f"[{index}] ValueError: Processes hold different devices: process 0 has 4 x cpu, process 1 has 2 x cpu."
                in proc.stdout), proc.stdout[-3000:]


def test_initialize_after_jax_started_says_to_call_it_first():
    assert px.distributed.initialize() == px.distributed.Processes(0, 1, 8, 8, "cpu")  # one process: nothing to start
    with pytest.raises(RuntimeError, match=r"must run before any other JAX call: this process has already started"):
        px.distributed.initialize("127.0.0.1:1", num_processes=2, process_id=0)


def test_ctrl_c_to_the_launcher_stops_every_process_at_one_step(tmp_path):
    env = child_env()
    command = [sys.executable, "-m", "parallax.launch", "--processes", "2", "--devices-per-process", "4", "--timeout",
               "240", SCRIPT, str(tmp_path), "--steps", STEPS, "--progress", *SLOW]
    proc = subprocess.Popen(list(map(str, command)), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("[0] step ") and "compiling" not in line:  # a step is done: training has started
            proc.send_signal(signal.SIGINT)
            break
    lines += proc.stdout.readlines()
    assert proc.wait(timeout=120) == 0, "".join(lines)[-4000:]
    printed = "".join(lines)
    # A Ctrl-C is called one: not JAX's "SIGTERM caught" (the SIGTERM each process sends itself to reach
    # JAX's preemption service), nor orbax's "Reached preemption sync point", printed by every thread.
    assert "[0] WARNING:parallax:SIGINT: finishing this step and saving it" in printed, printed[-3000:]
    assert "SIGTERM caught" not in printed and "Reached preemption sync point" not in printed, printed[-3000:]
    done = results(tmp_path)
    assert {r["stop_reason"] for r in done} == {"preempted"} and done[0]["step"] == done[1]["step"] < STEPS
    assert done[0]["checkpoints"][-1] == done[0]["step"]


@pytest.mark.budget(160, "fourteen layouts of the batch over 2 processes, 19 runs in one launch, the same here, and "
                        "px.plan of the same layouts on 2 simulated hosts (93-123 s cold; 157 s on jax 0.12)")
def test_every_layout_of_the_batch_over_the_processes_trains_like_one_process(tmp_path):
    """Each process feeds exactly the rows its devices hold, however the mesh's axes fall on the
    processes: with TP(4) x FSDP(2) the tensor axis spans the processes and each holds every row."""
    proc, _ = launch(tmp_path, script=LAYOUTS)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "[Gloo]" not in proc.stdout, proc.stdout[-2000:]  # its connection lines, hidden by the launcher
    os.makedirs(tmp_path / "here")
    reference = layouts_run.run(str(tmp_path / "here"))  # 1 x 8, in this process
    # Which axes of parallax's own meshes cross the 2 processes: what px.plan measures for 2 simulated hosts.
    own = {name: strategy() for name, (strategy, mesh) in layouts_run.LAYOUTS.items() if mesh is None}
    planned = {}
    for model, names in ((MLP(), [n for n in own if n not in layouts_run.STACKED]),
                         (StackedMLP(), layouts_run.STACKED)):
        rows = px.plan(model, optax.adamw(3e-3), layouts_run.batches(0, 1, True)[0], loss_fn=classifier_loss,
                       strategies=[own[n] for n in names], topology=px.Topology(2, 4), compile="jit").rows
        planned.update({name: row["links"]["crossing"] for name, row in zip(names, rows) if "links" in row})
    assert reference.pop("warned") == [] and not any(reference.pop("crossing").values())  # one process: one host
    assert reference.pop("summary hosts") is None
    cannot_fit = "mesh tensor4 across, iterable"
    for index, record in enumerate(json.load(open(tmp_path / f"layouts{i}.json")) for i in (0, 1)):  # noqa: SIM115 (read in a generator)
        # parallax's meshes are laid out over the processes as px.plan lays out 2 hosts of 4 devices (by the bytes
        # each layout moves across them, the same whatever order the parts are listed in), the batch-splitting axis
        # across them where each process's iterable part must fit; a user mesh whose tensor axis spans the
        # processes where another layout would not is warned about, and taken as it is.
        crossing, warned = record.pop("crossing"), record.pop("warned")
        inside, across = ("tensor", "fsdp") if planned["tp4+fsdp2"] == ["fsdp"] else ("fsdp", "tensor")
        hosts = record.pop("summary hosts")  # px.summarize: the mesh by host (process 1's device ids are JAX's)
        assert re.fullmatch(rf"over 2 hosts: '{inside}' inside each host, '{across}' across; host 0: devices 0-3, "
                            r"host 1: devices (\d+)-(\d+)", hosts), hosts
        for run, axes in planned.items():  # parallax's meshes: laid out as px.plan lays out 2 hosts of 4 devices
            assert crossing[f"{run}, arrays"] == axes, (run, crossing, planned)
        assert crossing["tp4+fsdp2, iterable"] == ["fsdp"], crossing  # the layout each process's part fits
        assert crossing["mesh tensor4 across, arrays"] == ["tensor"], crossing  # a user's mesh: as it is, warned
        assert warned == ["mesh fsdp4 in a process", "mesh tensor4 across"], warned
        calibrated = record.pop("calibrated")  # both links measured, each on its own (cost.calibrate)
        assert "|2 hosts|" in calibrated["key"] and calibrated["inside"] == calibrated["across"] == sorted(
            ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")), calibrated
        print("calibrated:", calibrated)
        uneven = record.pop("uneven parts")  # the same clear error on both processes, before training
        assert uneven.startswith("ValueError: The training data's batches per epoch (each process's) differs between "
                                 "processes: process 0 has 3, process 1 has 2."), uneven
        assert set(record) == set(reference), (set(record) ^ set(reference))
        for run, losses in record.items():
            if run == cannot_fit:
                continue
            assert isinstance(losses, list), (index, run, losses)
            assert max(abs(a - b) for a, b in zip(losses, reference[run])) <= TOL, (index, run, losses, reference[run])
        message = record[cannot_fit]
        assert message.startswith("ValueError: The training data is an iterable"), message
        assert ("{'tensor': 4, 'fsdp': 2}" in message and "process 0: rows 0-15; process 1: rows 0-15" in message
                and "leave mesh= out" in message), message
    assert isinstance(reference[cannot_fit], list)  # one process holds every row: its one part fits
    assert_no_process_left(tmp_path)


def _start_own_init(out, args, launcher):
    """2 processes x 2 devices of ``own_init_run.py``: through the launcher, or started by hand as
    a cluster's scheduler starts them (each with the coordinator's address, nothing watching them)."""
    os.makedirs(out, exist_ok=True)
    if launcher:
        command = [sys.executable, "-m", "parallax.launch", "--processes", "2", "--devices-per-process", "2",
                   "--timeout", "150", OWN_INIT, str(out), *args]
        return [subprocess.Popen(command, cwd=ROOT, env=child_env(), stdout=open(out / "out.txt", "w"),
                                 stderr=subprocess.STDOUT, start_new_session=True)]
    port = _free_port()
    started = []
    for index in range(2):
        env = child_env(devices=2, PARALLAX_COORDINATOR=f"127.0.0.1:{port}", PARALLAX_NUM_PROCESSES="2",
                        PARALLAX_PROCESS_ID=str(index), PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="1")
        with open(out / f"out{index}.txt", "w") as stdout:
            started.append(subprocess.Popen([sys.executable, OWN_INIT, str(out), *args], cwd=ROOT, env=env,
                                            stdout=stdout, stderr=subprocess.STDOUT, start_new_session=True))
    return started


@pytest.mark.budget(45, "four launches of 2 processes at once (through the launcher and by hand; a raise and a "
                        "SIGKILL), one of them waiting out a 10 s heartbeat")
def test_a_script_that_starts_jax_itself_ends_every_process_together_on_short_data_a_raise_or_a_kill(tmp_path):
    runs = {(mode, fault): tmp_path / f"{mode}_{fault}" for mode in ("launcher", "by_hand")
            for fault in ("raise", "kill")}
    faults = {"raise": ["--short", "1:3", "--raise", "1:5"], "kill": ["--sigkill", "1:7"]}
    started = {key: _start_own_init(out, faults[key[1]], key[0] == "launcher") for key, out in runs.items()}
    ended: dict = {}
    deadline = time.time() + 200
    try:
        while len(ended) < sum(map(len, started.values())) and time.time() < deadline:
            for key, procs in started.items():
                for index, proc in enumerate(procs):
                    if (key, index) not in ended and proc.poll() is not None:
                        ended[key, index] = (proc.returncode, time.time())
            time.sleep(0.2)
    finally:
        for procs in started.values():
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
    for (mode, fault), out in runs.items():
        text = {i: open(out / name).read() for i, name in enumerate(sorted(p.name for p in out.glob("out*.txt")))}  # noqa: SIM115 (read in a comprehension)
        whole = "\n".join(text.values())
        codes = [ended.get(((mode, fault), i), (None, None))[0] for i in range(len(started[mode, fault]))]
        with open(out / "fault.json") as f:
            fault_record = json.load(f)
        assert fault_record["process"] == 1, whole[-3000:]
        slowest = max(when for (key, _), (_, when) in ended.items() if key == (mode, fault))
        assert slowest - fault_record["time"] < 30, (mode, fault, slowest - fault_record["time"], whole[-3000:])
        # One line says what parallax applied to a run JAX was started for without it, and how to get the rest.
        assert "jax.distributed was started without px.distributed.initialize()" in text[0], whole[-3000:]
        assert mode == "by_hand" or "[Gloo]" not in whole, whole[-2000:]  # the launcher hides Gloo's lines
        if fault == "raise":
            # The generator of process 1 ends 3 batches early: both stop at its last step, saying so.
            short = [json.load(open(out / f"short{i}.json")) for i in (0, 1)]  # noqa: SIM115 (read in a comprehension)
            assert short[0] == short[1] and short[0]["stop_reason"] == "data exhausted" and short[0]["step"] == 9, short
            assert whole.count("The training data of process 1 ended after step 9 while the other processes had "
                               "more; every process stops at step 9") == 2, whole[-3000:]
            assert "RuntimeError: planted failure in process 1 at step 5" in whole
            named = ("[launch] process 1 exited with code 1" if mode == "launcher" else  # it ends the others itself
                     "parallax: process 1 of 2 failed at step 5 (RuntimeError: planted failure in process 1 "
                     "at step 5); process 0 stops too")
            assert named in whole, whole[-3000:]
            assert codes == ([1] if mode == "launcher" else [1, 1]), (codes, whole[-3000:])
        else:
            if mode == "launcher":
                assert codes == [128 + 9] and "[launch] process 1 was killed by SIGKILL" in whole, whole[-3000:]
            else:
                assert codes == [1, -9], (codes, whole[-3000:])
                assert "parallax: process 1 of 2 has sent no heartbeat for 10 s" in text[0], text[0][-3000:]
        assert not any(out.glob("done*.json"))  # no process carried on as if it had finished
        assert_no_process_left(out)
