"""Each example runs a few steps under DP, FSDP and a hybrid, as a user would start it."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_example(script, *args):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    proc = subprocess.run([sys.executable, os.path.join("examples", script), "--devices", "8", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "dp+fsdp+tp"])  # DP alone: the NNX twin below
def test_image_classifier(strategy):
    out = run_example("image_classifier.py", "--strategy", strategy, "--config.trainer.max_steps=4",
                      "--config.trainer.progress=False")
    assert "8 CPU device(s)" in out and "test accuracy" in out and "after 4 steps" in out


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["dp", "fsdp+tp"])
def test_nnx_classifier(strategy):
    out = run_example("nnx_classifier.py", "--strategy", strategy, "--config.trainer.max_steps=4",
                      "--config.trainer.progress=False")
    trained = re.search(r"test accuracy (\S+), .* after 4 steps", out).group(1)
    assert f"the trained NNX module itself, in eval mode: test accuracy {trained}" in out


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["dp", "fsdp+tp"])  # its default, and the other compile path
def test_char_lm(strategy, tmp_path):
    text = tmp_path / "tiny.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    out = run_example("char_lm.py", "--strategy", strategy, "--text", str(text), "--config.trainer.max_steps=3",
                      "--config.sample_length=20", "--config.model.features=32", "--config.trainer.progress=False")
    assert "validation loss" in out and "sample:\nhe " in out  # "T" is not in this text


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["dp+fsdp"])  # both kinds of data axis; each alone is in the equivalence grid
def test_resnet_from_a_published_package(strategy):
    out = run_example("resnet.py", "--strategy", strategy, "--config.trainer.max_steps=2",
                      "--config.trainer.eval_batch_size=2048", "--config.trainer.progress=False",
                      "--config.dataset=digits")
    assert "jax_resnet.ResNet18" in out and "after 2 steps" in out
