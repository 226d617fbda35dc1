"""What a pipeline or gradient accumulation splits into microbatches computes what the whole batch
computes, or is refused before training, naming the operation and the fix.

The model: a scanned stack of Switch-style mixture-of-experts blocks that drop tokens at a capacity
and return their load-balancing loss per layer (the scan's ys, which the pipeline returns as the
scan does), routed as GShard writes it, over the flattened batch x sequence (one group: each token's slot counts
the tokens of every example before it, and the capacity is counted over the whole batch), or in groups
of one sequence (each example routed on its own). Per microbatch the first drops other tokens than the
whole batch does: shown here, then refused under a pipeline and under accumulation; the second is
exact against a plain one-device optax loop.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import parallax as px
from tests.reference import max_diff, one_device_state, run_plain
from tests.test_expert_parallel import route

pytestmark = pytest.mark.core

EXPERTS = 4


class RoutedBlock(nn.Module):
    """Top-1 routing to 4 stacked experts with a capacity (the rest dropped), over ``groups``."""

    groups: str = "sequence"  # or "flat": the whole batch x sequence as one group
    capacity_factor: float = 1.0

    @nn.compact
    def __call__(self, x, _):
        h = nn.LayerNorm()(x)
        batch, length, width = h.shape
        tokens = h.reshape(1, batch * length, width) if self.groups == "flat" else h
        probs = jax.nn.softmax(nn.Dense(EXPERTS, use_bias=False, name="router")(tokens))
        capacity = max(1, int(self.capacity_factor * tokens.shape[1] / EXPERTS))
        combine = route(probs, 1, capacity)[0]
        init = nn.initializers.lecun_normal(batch_axis=(0,))
        w_in, w_out = self.param("w_in", init, (EXPERTS, width, 32)), self.param("w_out", init, (EXPERTS, 32, width))
        dispatched = jnp.einsum("gtec,gtd->egcd", (combine > 0).astype(h.dtype), tokens)
        out = jnp.einsum("egch,ehd->egcd", nn.gelu(jnp.einsum("egcd,edh->egch", dispatched, w_in)), w_out)
        # Switch's load-balancing loss of each group, averaged over the groups: returned per layer.
        first = jax.nn.one_hot(jnp.argmax(probs, -1), EXPERTS)
        balance = EXPERTS * jnp.mean(jnp.sum(first.mean(1) * probs.mean(1), -1))
        return x + jnp.einsum("egcd,gtec->gtd", out, combine).reshape(x.shape), balance


class RoutedStack(nn.Module):
    """Four routed blocks scanned by ``nn.scan``, each returning its load-balancing loss (the scan's ys)."""

    groups: str = "sequence"

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(64, 16)(tokens)
        block = nn.scan(RoutedBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=4)
        x, balance = block(groups=self.groups, capacity_factor=0.5)(x, None)
        return nn.Dense(64)(nn.LayerNorm()(x)), balance


def loss_fn(model, batch):
    logits, balance = model(batch["x"][:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["x"][:, 1:]).mean() + 0.01 * balance.sum()


def data(steps: int = 2) -> list[dict]:
    rng = np.random.default_rng(0)
    return [{"x": rng.integers(0, 64, (16, 9)).astype(np.int32)} for _ in range(steps)]


@pytest.fixture(scope="module")
def flat_start():
    return one_device_state(RoutedStack("flat"), optax.adamw(1e-2), data()[0], loss_fn)


def test_routing_over_the_whole_batch_drops_other_tokens_per_microbatch(flat_start):
    """Why the flat model is refused below: its loss on the batch is not the mean of its halves'
    (the refusal is not cautious; it prevents a wrong result). Routed per sequence, the logits are
    the halves' rows and the balance loss their mean."""
    model, params = RoutedStack("flat"), flat_start.params
    batch = data()[0]["x"][:, :-1]
    whole = loss_fn(lambda x: model.apply({"params": params}, x), data()[0])
    halves = [loss_fn(lambda x: model.apply({"params": params}, x), {"x": data()[0]["x"][rows]})
              for rows in (slice(0, 8), slice(8, 16))]
    assert abs(float(whole) - float(np.mean(halves))) > 1e-3, (whole, halves)
    sequence = RoutedStack("sequence")
    (whole, balance), halves = sequence.apply({"params": params}, batch), [
        sequence.apply({"params": params}, batch[rows]) for rows in (slice(0, 8), slice(8, 16))]
    assert float(jnp.abs(whole - jnp.concatenate([logits for logits, _ in halves])).max()) < 1e-5
    assert float(jnp.abs(balance - (halves[0][1] + halves[1][1]) / 2).max()) < 1e-6  # a mean over the sequences


@pytest.mark.parametrize("strategy", [
    pytest.param(lambda: px.combine(px.PipelineParallel(2), px.FSDP(4, min_weight_size=0)), id="pp2-fsdp4"),
    pytest.param(lambda: px.combine(px.PipelineParallel(2), px.ExpertParallel(4)), id="pp2-ep4"),
])
def test_a_pipeline_refuses_blocks_that_route_over_the_whole_batch_and_trains_per_sequence_routing_exactly(
        strategy):
    with pytest.raises(ValueError) as refused:
        px.testing.assert_equivalent(RoutedStack("flat"), optax.adamw(1e-2), loss_fn, data(), strategy())
    message = str(refused.value)
    assert ("The stack's layers do not compute each example on its own: it takes cumsum along the examples (at "
            in message and "test_expert_parallel.py" in message and "(route)" in message), message
    assert "microbatches of 4 of the batch's 16 rows" in message and "groups of one sequence" in message, message
    report = px.testing.assert_equivalent(RoutedStack("sequence"), optax.adamw(1e-2), loss_fn, data(), strategy())
    assert report.passed, report


def test_accumulation_refuses_a_loss_whose_microbatches_compute_otherwise():
    strategy = px.FSDP(8, min_weight_size=0)
    flat = px.init_state(RoutedStack("flat"), optax.adamw(1e-2), data()[0], strategy=strategy, rng=0, loss_fn=loss_fn)
    step = px.make_train_step(loss_fn, strategy, grad_accum=2)
    with pytest.raises(ValueError) as refused:
        step(flat, data()[0])
    message = str(refused.value)
    assert "grad_accum=2" in message and "it takes cumsum along the examples (at " in message, message
    assert "px.per_example_loss" in message and "groups of one sequence" in message, message


def test_accumulation_of_per_sequence_routing_trains_as_the_whole_batch_on_one_device():
    strategy, tx = px.FSDP(8, min_weight_size=0), optax.adamw(1e-2)
    start = one_device_state(RoutedStack("sequence"), tx, data()[0], loss_fn)
    reference = run_plain(RoutedStack("sequence"), tx, loss_fn, start, data())
    state = px.init_state(RoutedStack("sequence"), tx, data()[0], strategy=strategy, params=start.params,
                          loss_fn=loss_fn)
    step = px.make_train_step(loss_fn, strategy, grad_accum=2)
    losses = []
    for batch in data():
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert np.abs(np.array(losses) - reference.losses).max() <= 1e-5, (losses, reference.losses)
    assert max_diff(jax.device_get(state.params), reference.params) <= 1e-5


def test_expert_parallelism_moves_the_tokens_of_a_stack_routed_per_sequence_by_all_to_all():
    """Under ExpertParallel the dispatched tokens ``[experts, sequences, capacity, d]`` of each
    scanned block move to their experts' devices by all-to-all and back, instead of every device
    gathering the whole batch's hidden states (``[16, 8, 16]``, 119 KB of all-gathers a step
    before): px.plan reads it from the compiled step, beside data parallelism's."""
    batch = data(1)[0]
    strategies = [px.DataParallel(8), px.combine(px.ExpertParallel(4), px.DataParallel(2))]
    rows = px.plan(RoutedStack("sequence"), optax.sgd(0.1), batch, loss_fn=loss_fn, strategies=strategies,
                   compile="jit").rows
    moved = [{kind: stat["bytes"] for kind, stat in row["collectives"].items() if stat["count"]} for row in rows]
    data_parallel, experts = moved
    assert experts.get("all-gather", 0) <= data_parallel.get("all-gather", 0), moved
    assert experts.get("all-to-all", 0) > 0, moved
    assert sum(experts.values()) < sum(data_parallel.values()), moved  # the experts' gradients stay on their devices
