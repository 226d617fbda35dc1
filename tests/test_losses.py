"""Losses that are not a mean of per-example terms train exactly like one device, by default.

A masked-LM loss normalised by the batch's count of masked tokens, a mixture-of-experts
load-balancing term computed from the whole batch's routing, and an in-batch-negative
contrastive loss: each changes meaning if every data shard computes it alone and the
shards' losses are averaged. With default arguments every strategy must match a plain
one-device optax loop on them; ``compile="shard_map"`` (per-shard semantics, asked for
explicitly) must not, which shows the cases really tell the two apart.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import parallax as px
from tests import tiers
from tests.models import TinyLM
from tests.reference import (
    OPTIMIZERS,
    STRATEGIES,
    Drift,
    bound,
    drift_floor,
    one_device_state,
    params_bound,
    run_plain,
    run_steps,
)

pytestmark = pytest.mark.core

STEPS = 6


# --- the three losses, each on a small model ---------------------------------------------
def masked_lm_loss(model, batch):
    """Cross-entropy over masked positions, divided by the batch's number of them."""
    logits = model(batch["x"], train=True)
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    mask = batch["mask"].astype(jnp.float32)
    return (per_token * mask).sum() / mask.sum()


class MoE(nn.Module):
    """A top-1 routed mixture of four experts (dense compute), with its router's statistics."""

    experts: int = 4
    hidden: int = 32

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.relu(nn.Dense(self.hidden, name="embed_in")(x))
        probs = nn.softmax(nn.Dense(self.experts, name="router")(x))
        choice = jax.nn.one_hot(probs.argmax(-1), self.experts)
        outputs = jnp.stack([nn.Dense(x.shape[-1], name=f"down_{e}")(nn.relu(nn.Dense(2 * self.hidden,
                             name=f"up_{e}")(x))) for e in range(self.experts)], axis=1)
        x = x + jnp.einsum("be,bef->bf", choice * probs, outputs)
        return nn.Dense(10, name="head")(x), probs, choice


def moe_loss(model, batch):
    """Cross-entropy plus the Switch-Transformer balancing term over the batch's routing."""
    logits, probs, choice = model(batch["x"], train=True)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    balance = probs.shape[-1] * jnp.sum(choice.mean(0) * probs.mean(0))
    return ce + 0.5 * balance, {"balance": balance}


class Tower(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Dense(48, name="up")(x)
        return nn.Dense(16, name="down")(nn.gelu(x))


def contrastive_loss(model, batch):
    """InfoNCE with in-batch negatives: each row's positive is its own pair, the rest negatives."""
    a = model(batch["x"], train=True)
    b = model(batch["x_pair"], train=True)
    a = a / jnp.linalg.norm(a, axis=-1, keepdims=True)
    b = b / jnp.linalg.norm(b, axis=-1, keepdims=True)
    logits = a @ b.T / 0.1
    labels = jnp.arange(a.shape[0])
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def make_batches(kind: str, steps: int = STEPS, batch_size: int = 16) -> list[dict]:
    rng = np.random.default_rng(1)
    out = []
    for _ in range(steps):
        if kind == "masked_lm":
            # Masked positions differ in number from row to row, so shards hold different counts.
            out.append({"x": rng.integers(0, 64, (batch_size, 8)).astype(np.int32),
                        "y": rng.integers(0, 64, (batch_size, 8)).astype(np.int32),
                        "mask": rng.random((batch_size, 8)) < rng.uniform(0.05, 0.6, (batch_size, 1))})
        elif kind == "moe":
            out.append({"x": rng.normal(size=(batch_size, 24)).astype(np.float32),
                        "y": rng.integers(0, 10, batch_size).astype(np.int32)})
        else:
            x = rng.normal(size=(batch_size, 24)).astype(np.float32)
            out.append({"x": x, "x_pair": (x + 0.3 * rng.normal(size=x.shape)).astype(np.float32)})
    return out


CASES = {"masked_lm": (TinyLM, masked_lm_loss), "moe": (MoE, moe_loss), "contrastive": (Tower, contrastive_loss)}


@functools.cache
def reference(case: str, opt_name: str):
    model_cls, loss_fn = CASES[case]
    data = make_batches(case)
    state = one_device_state(model_cls(), OPTIMIZERS[opt_name](), data[0], loss_fn)
    return jax.device_get(state.params), run_plain(model_cls(), OPTIMIZERS[opt_name](), loss_fn, state, data)


def initial_state(case: str, opt_name: str, strategy: px.Strategy) -> px.TrainState:
    model_cls, loss_fn = CASES[case]
    init_params = reference(case, opt_name)[0]
    return px.init_state(model_cls(), OPTIMIZERS[opt_name](), make_batches(case, 1)[0], strategy=strategy, rng=0,
                         loss_fn=loss_fn, params=init_params)


def train(case: str, opt_name: str, strategy: px.Strategy, **step_options):
    _, loss_fn = CASES[case]
    state = initial_state(case, opt_name, strategy)
    step = px.make_train_step(loss_fn, strategy, **step_options)
    state, losses = run_steps(step, state, make_batches(case))
    return losses, jax.device_get(state.params), step


@functools.cache
def floor(case: str, opt_name: str, strategy: px.Strategy) -> Drift:
    """How far plain jit drifts from one device with the same values placed on the mesh."""
    model_cls, loss_fn = CASES[case]
    return drift_floor(model_cls(), OPTIMIZERS[opt_name](), loss_fn, initial_state(case, opt_name, strategy),
                       make_batches(case), strategy, reference(case, opt_name)[1])


# SGD on every strategy (it shows a wrong gradient scale; Adam hides it), AdamW on the hybrid.
GRID = [(s, "sgd") for s in STRATEGIES] + [("dp+fsdp+tp", "adamw")]


LOSS_GRID = [(case, s, o) for case in CASES for s, o in GRID]


@pytest.mark.parametrize("case, strategy_name, opt_name", tiers.cases(
    LOSS_GRID, [(case, "dp+fsdp+tp", "adamw") for case in CASES]))
def test_batch_level_loss_is_exact_by_default(case, strategy_name, opt_name):
    _, ref = reference(case, opt_name)
    strategy = STRATEGIES[strategy_name]()
    losses, params, step = train(case, opt_name, strategy)
    assert step.mode() == "jit"  # the loss sees the global batch
    loss_diff = float(np.abs(losses - ref.losses).max())
    loss_tol = bound(loss_diff, lambda: floor(case, opt_name, strategy).losses)  # max(1e-5, twice jit's own drift)
    params_diff, params_tol = params_bound(params, ref, lambda: floor(case, opt_name, strategy))
    print(f"{case}/{strategy_name}/{opt_name}: loss diff {loss_diff:.2e} (bound {loss_tol:.1e}), "
          f"final params diff {params_diff:.2e} (bound {params_tol:.1e})")
    assert loss_diff <= loss_tol, (case, strategy_name, losses, ref.losses)
    assert params_diff <= params_tol, (case, strategy_name, params_diff)


@pytest.mark.parametrize("case", list(CASES))
def test_per_shard_semantics_only_when_asked(case):
    """compile="shard_map" (explicit) averages per-shard losses: a different objective here."""
    _, ref = reference(case, "sgd")
    losses, _, step = train(case, "sgd", px.DataParallel(), compile="shard_map")
    assert step.mode() == "shard_map"
    assert np.abs(losses - ref.losses).max() > 1e-3


def test_a_marked_per_example_loss_may_run_per_shard():
    def mean_loss(model, batch):
        logits, _, _ = model(batch["x"], train=True)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    marked = px.per_example_loss(mean_loss)
    assert px.is_per_example_loss(marked) and not px.is_per_example_loss(mean_loss)
    assert px.per_example_loss(marked) is marked
    assert px.make_train_step(marked, px.DataParallel()).modes() == ("jit", "shard_map")  # the cost model picks
    assert px.make_train_step(marked, px.DataParallel()).mode() == "auto"  # until the first call
    assert px.make_train_step(mean_loss, px.DataParallel()).mode() == "auto"  # its trace is read at the first call
    assert px.make_eval_step(mean_loss, px.DataParallel()).mode() == "jit"
    with pytest.raises(ValueError, match="takes a loss function"):
        px.per_example_loss(3)
