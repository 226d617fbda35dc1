"""Each example runs a few steps under DP, FSDP and a hybrid, as a user would start it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.environment import child_env

pytestmark = pytest.mark.wide("the examples, each run as a user runs it, in a process of its own")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_example(script, *args):
    env = child_env()
    proc = subprocess.run([sys.executable, os.path.join("examples", script), "--devices", "8", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.budget(60, "the example twice in its own process, a checkpoint every step of 30, killed and resumed")
def test_image_classifier_on_grain_killed_and_resumed_ends_like_an_uninterrupted_run(tmp_path):
    """SIGKILLed as soon as its first checkpoint is committed, then run again with --resume (FSDP;
    DP and the hybrids: the other examples)."""
    steps, ckpt = 30, tmp_path / "ckpt"
    args = ["--strategy", "fsdp", "--config.pipeline=grain", f"--config.trainer.max_steps={steps}",
            "--config.trainer.progress=False", "--config.trainer.eval_every=1000"]
    env = child_env()
    command = [sys.executable, os.path.join("examples", "image_classifier.py"), "--devices", "8", *args,
               f"--config.trainer.checkpoint_dir={ckpt}", "--config.trainer.checkpoint_every=1"]
    killed = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    deadline = time.monotonic() + 300
    while killed.poll() is None and not any(name.isdigit() for name in _listing(ckpt)):
        assert time.monotonic() < deadline, "no checkpoint within 300 s"
        time.sleep(0.005)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    saved = sorted(int(name) for name in _listing(ckpt) if name.isdigit())
    assert killed.returncode == -signal.SIGKILL and saved and saved[-1] < steps, (killed.returncode, saved)
    resumed = run_example("image_classifier.py", *args, f"--config.trainer.checkpoint_dir={ckpt}",
                          "--config.trainer.checkpoint_every=1", "--resume")
    straight = run_example("image_classifier.py", *args)
    assert "8 CPU device(s)" in straight
    final = re.compile(rf"test accuracy \S+, test loss \S+ after {steps} steps")
    assert final.search(resumed).group(0) == final.search(straight).group(0), (resumed, straight)


def _listing(folder) -> list[str]:
    return os.listdir(folder) if os.path.isdir(folder) else []


@pytest.mark.parametrize("strategy", ["dp", "fsdp+tp"])
def test_nnx_classifier(strategy):
    out = run_example("nnx_classifier.py", "--strategy", strategy, "--config.trainer.max_steps=4",
                      "--config.trainer.progress=False")
    trained = re.search(r"test accuracy (\S+), .* after 4 steps", out).group(1)
    assert f"the trained NNX module itself, in eval mode: test accuracy {trained}" in out


@pytest.mark.parametrize("strategy", ["dp", "fsdp+tp"])  # its default, and the other compile path
def test_char_lm(strategy, tmp_path):
    text = tmp_path / "tiny.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    out = run_example("char_lm.py", "--strategy", strategy, "--text", str(text), "--config.trainer.max_steps=3",
                      "--config.sample_length=20", "--config.model.features=32", "--config.trainer.progress=False")
    assert "validation loss" in out and "sample:\nhe " in out  # "T" is not in this text


@pytest.mark.parametrize("strategy", ["dp+fsdp"])  # both kinds of data axis; each alone is in the equivalence grid
def test_resnet_from_a_published_package(strategy):
    out = run_example("resnet.py", "--strategy", strategy, "--config.trainer.max_steps=2",
                      "--config.trainer.eval_batch_size=2048", "--config.trainer.progress=False",
                      "--config.dataset=digits")
    assert "jax_resnet.ResNet18" in out and "after 2 steps" in out
