"""Docs that run: every docstring example in parallax, executed (one test per module).

The examples share a small namespace (below): an auto-named MLP, a classification loss with
an accuracy metric, a batch, a sharded state built for it, and tiny train/eval sets. A
docstring that names ``state`` gets a fresh one, since a train step donates its input.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import parallax as px

pytestmark = pytest.mark.core


class MLP(nn.Module):
    """Auto-named layers, as most user models have: ``Dense_0`` … ``Dense_2``."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64)(x))
        x = nn.relu(nn.Dense(64)(x))
        return nn.Dense(10)(x)


def loss_fn(model, batch):
    logits = model(batch["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, {"accuracy": (logits.argmax(-1) == batch["y"]).mean()}


def _examples(n: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(n, 16)).astype(np.float32), "y": rng.integers(0, 10, n).astype(np.int32)}


def namespace(source: str, tmp_path) -> dict:
    model = MLP()
    batch = _examples(32, 0)
    train_data, eval_data = _examples(256, 1), _examples(64, 2)

    def make_state():
        return px.init_state(model, optax.adam(1e-3), batch, strategy=px.DataParallel(), loss_fn=loss_fn)

    names = {
        "px": px, "jax": jax, "jnp": jnp, "np": np, "nn": nn, "optax": optax,
        "model": model, "loss_fn": loss_fn, "batch": batch, "train_data": train_data, "eval_data": eval_data,
        "x_train": train_data["x"], "y_train": train_data["y"], "make_state": make_state,
        "ckpt_dir": str(tmp_path / "ckpt"),
    }
    if re.search(r"\bstate\b", source):  # a train step donates its input: each docstring gets its own
        names["state"] = px.init_state(model, optax.adam(1e-3), batch, strategy=px.FSDP(split="largest"),
                                       loss_fn=loss_fn)
    if re.search(r"\bstep\b", source):
        names["step"] = px.make_train_step(loss_fn, px.FSDP())
    return names


def _modules() -> list[str]:
    found = ["parallax"]
    for info in pkgutil.walk_packages(px.__path__, "parallax."):
        found.append(info.name)
    return sorted(found)


MODULES = _modules()


def test_every_module_is_collected():
    assert {"parallax.step.build", "parallax.train.trainer", "parallax.sharding.strategy",
            "parallax.models.linen"} <= set(MODULES)


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.wide(
    "its examples run the search of strategy='auto' (12 s cold)")) if name == "parallax.state.search" else name
    for name in MODULES])
def test_docstring_examples_run(name, tmp_path):
    module = importlib.import_module(name)
    tests = [t for t in doctest.DocTestFinder(exclude_empty=True).find(module, name) if t.examples]
    if not tests:
        return
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in tests:
        source = "\n".join(example.source for example in test.examples)
        test.globs.update(namespace(source, tmp_path))
        runner.run(test)
    results = runner.summarize(verbose=False)
    assert results.failed == 0, f"{results.failed} of {results.attempted} docstring examples in {name} failed (above)"
