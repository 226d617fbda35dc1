"""The fault suite: kill, interrupt and damage real training runs, then resume them.

Every fault is driven as it happens to a user: a training process (``tests/scripts/train_run.py``,
a small transformer LM under FSDP on 8 simulated devices, checkpoints every 3 steps) gets a
real signal at a step drawn with a fixed seed (a SIGKILL as soon as the newest due
checkpoint is committed, so its checksum record must have committed with it), or its newest
checkpoint's files are damaged on disk; then ``fit(resume=True)`` runs to the end in a new
process. A fault is survived when the resumed run ends bitwise equal to an uninterrupted one. Resuming onto another
strategy or device count restores the newest checkpoint (step 6) there and stops: the
restored state must equal the uninterrupted run's state at step 6 bitwise (training on
under another strategy then differs only by float rounding, which the equivalence tests
bound). The suite prints ``faults survived k/n`` in the test summary.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.wide("the fault runs: each an interrupted and a resumed run in processes of their own")

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "train_run.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 10


def run(*args):
    return subprocess.run([sys.executable, SCRIPT, *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


def load(path):
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


def damage(folder, how):
    files = [os.path.join(root, name) for root, _, names in os.walk(folder) for name in names
             if name != "parallax_checksums.json"]
    victim = max(files, key=os.path.getsize)
    with open(victim, "rb") as f:
        raw = bytearray(f.read())
    if how == "flip a bit":
        raw[len(raw) // 3] ^= 0x10
        with open(victim, "wb") as f:
            f.write(bytes(raw))
    elif how == "truncate":
        with open(victim, "wb") as f:
            f.write(bytes(raw[: len(raw) // 2]))
    else:
        os.remove(victim)


def scenarios(seed=0):
    rng = np.random.default_rng(seed)
    at = lambda: int(rng.integers(2, STEPS - 1))
    # (name, fault, exit code of the faulted run, damage to the newest checkpoint, resume args, resume to step)
    out = [(f"SIGKILL at step {k}", ("--sigkill-at", k), -signal.SIGKILL, None, (), STEPS) for k in (at(),)]
    out += [(f"SIGTERM at step {k}", ("--sigterm-at", k), 0, None, (), STEPS) for k in (at(),)]
    out += [(f"SIGINT at step {k}", ("--sigint-at", k), 0, None, (), STEPS) for k in (at(),)]
    out += [(f"SIGKILL at step 7, then {how} in the newest checkpoint", ("--sigkill-at", 7), -signal.SIGKILL, how, (),
             STEPS) for how in ("flip a bit", "truncate", "delete a file")]
    out += [("SIGKILL at step 7, restored under DataParallel", ("--sigkill-at", 7), -signal.SIGKILL, None,
             ("--strategy", "dp"), 6),
            ("SIGKILL at step 7, restored on 4 devices", ("--sigkill-at", 7), -signal.SIGKILL, None,
             ("--devices", 4), 6)]
    return out


@pytest.mark.budget(120, "8 faults, each an interrupted and a resumed run in processes of their own (about 20 "
                         "processes)")
def test_faults_survived(tmp_path, record_property):
    references = {}
    for steps in (STEPS, 6):
        straight = run(tmp_path / f"straight{steps}", tmp_path / f"straight{steps}.npz", steps)
        assert straight.returncode == 0, straight.stderr[-3000:]
        references[steps] = load(tmp_path / f"straight{steps}.npz")
    survived, failures, interrupted = 0, [], {}
    cases = scenarios()
    for index, (name, fault, code, how, resume_args, resume_steps) in enumerate(cases):
        ckpt, out = tmp_path / f"run{index}", tmp_path / f"run{index}.npz"
        if fault in interrupted:  # the same faulted run: work on a copy of its checkpoints
            shutil.copytree(interrupted[fault][0], ckpt)
            broken = interrupted[fault][1]
        else:
            broken = run(ckpt, tmp_path / "unused.npz", STEPS, *fault)
            keep = tmp_path / f"pristine{index}"
            shutil.copytree(ckpt, keep)
            interrupted[fault] = (keep, broken)
        problems = []
        if broken.returncode != code:
            problems.append(f"the interrupted run exited {broken.returncode}, not {code}: {broken.stderr[-500:]}")
        if how is not None:
            newest = max(int(s) for s in os.listdir(ckpt) if s.isdigit())
            damage(ckpt / str(newest), how)
        resumed = run(ckpt, out, resume_steps, "--resume", *resume_args)
        if resumed.returncode != 0:
            problems.append(f"the resumed run failed: {resumed.stderr[-800:]}")
        elif how is not None and "fails verification" not in resumed.stderr:
            problems.append("the damaged checkpoint was not reported")
        elif "unverified" in resumed.stderr:  # killed right after a commit: the record committed with it
            problems.append("the newest checkpoint had no checksum record")
        else:
            again, reference = load(out), references[resume_steps]
            differing = [key for key in reference if not np.array_equal(again[key], reference[key])]
            if differing:
                problems.append(f"{len(differing)} arrays differ from the uninterrupted run, e.g. {differing[0]}")
        if problems:
            failures.append(f"{name}: " + "; ".join(problems))
        else:
            survived += 1
    record_property("faults_survived", f"{survived}/{len(cases)}")
    assert not failures, "\n".join(failures)
