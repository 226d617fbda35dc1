"""The pipeline schedule (``parallax.parallel.pipeline.schedule``) against a plain ``lax.scan`` on one device.

The layer divides by the mean of its input, so the zeros a stage sees in its bubble (before its
first microbatch arrives) give NaN there: any of it reaching an output or a gradient fails.
"""

from __future__ import annotations

import functools
import itertools
import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import parallax as px
from parallax.parallel.pipeline.schedule import pipeline
from parallax.parallel.pipeline.stack import pipelined
from parallax.parallel.pipeline.stacked_blocks import StackedBlocks
from tests import tiers

pytestmark = pytest.mark.core

WIDTH, ROWS = 4, 16


def layer(w, h, c, shared):
    return jnp.tanh(h @ w["kernel"] + w["bias"] * shared) * c["scale"] + h / jnp.mean(h, axis=-1, keepdims=True)


def values(layers, seed=0):
    rng = np.random.default_rng(seed)
    weights = {"kernel": rng.uniform(0.1, 0.5, (layers, WIDTH, WIDTH)).astype(np.float32),
               "bias": rng.uniform(0.0, 0.1, (layers, WIDTH)).astype(np.float32)}
    inputs = rng.uniform(0.5, 1.5, (ROWS, WIDTH)).astype(np.float32)
    constants = {"scale": rng.uniform(0.5, 1.0, (ROWS, 1)).astype(np.float32)}
    cotangent = rng.normal(size=(ROWS, WIDTH)).astype(np.float32)
    return weights, inputs, constants, np.float32(1.5), cotangent


def one_device(weights, inputs, constants, shared, cotangent):
    def loss(w, x, c, s):
        out = jax.lax.scan(lambda h, wl: (layer(wl, h, c, s), None), x, w)[0]
        return jnp.sum(out * cotangent), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
        weights, inputs, constants, shared)
    return out, grads


@pytest.mark.parametrize("stages, microbatches, repeats, per_stage, data", [
    (2, 2, 1, 2, 1),  # GPipe, two layers a stage
    (4, 8, 1, 1, 2),  # more microbatches than stages, beside a data axis
    (2, 2, 2, 1, 1),  # circular, as many microbatches as stages
    (4, 8, 2, 1, 1),  # circular, more microbatches than stages
    (2, 4, 2, 2, 2),  # circular, two layers a group, beside a data axis
    (4, 4, 1, 10, 2),  # 10 layers over 4 stages: 3, 3, 2, 2 (a shorter stage passes its input on in its last slot)
    (2, 2, 2, 7, 1),  # circular, 7 layers in 4 groups: 2, 2, 2, 1
])
def test_the_pipeline_computes_the_stack_and_its_gradients(stages, microbatches, repeats, per_stage, data):
    """``per_stage`` layers a group, or (over ``stages × repeats``) the stack's layer count, uneven."""
    layers = per_stage if per_stage > stages * repeats else stages * repeats * per_stage
    weights, inputs, constants, shared, cotangent = values(layers)
    expected, expected_grads = one_device(weights, inputs, constants, shared, cotangent)
    mesh = Mesh(np.array(jax.devices()[:stages * data]).reshape(stages, data), ("stage", "data"))

    def loss(w, x, c, s):
        out = pipeline(layer, w, x, c, s, mesh=mesh, axis="stage", microbatches=microbatches, repeats=repeats)
        return jnp.sum(out * cotangent), out

    place = lambda tree, spec: jax.device_put(tree, NamedSharding(mesh, spec))
    args = (place(weights, P("stage") if layers % stages == 0 else P()), place(inputs, P("data")),
            place(constants, P("data")), place(shared, P()))
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(*args)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("stages, microbatches, repeats, layers, rows, message", [
    (4, 2, 1, 3, 16, "3 layers, fewer than 4 stages × repeats=1 groups of layers: use at most 3"),
    (2, 2, 2, 3, 16, "3 layers, fewer than 2 stages × repeats=2 groups"),
    (2, 3, 1, 4, 16, "microbatches=3 does not divide the batch of 16 rows"),
    (4, 2, 2, 8, 16, "microbatches=2 < 4 stages; use microbatches >= 4"),
])
def test_a_stack_it_cannot_pipeline_is_an_error_naming_the_value(stages, microbatches, repeats, layers, rows, message):
    mesh = Mesh(np.array(jax.devices()[:stages]), ("stage",))
    weights = {"kernel": jnp.ones((layers, WIDTH, WIDTH)), "bias": jnp.ones((layers, WIDTH))}
    with pytest.raises(ValueError, match=message):
        pipeline(layer, weights, jnp.ones((rows, WIDTH)), {"scale": jnp.ones((rows, 1))}, 1.0, mesh=mesh,
                 axis="stage", microbatches=microbatches, repeats=repeats)


class Block(nn.Module):
    """A residual block reading a per-example mask, as a model writes it."""

    @nn.compact
    def __call__(self, h, mask):
        # relu and softmax have custom JVP rules, traced only when differentiated inside the pipeline
        return h + nn.Dense(WIDTH)(nn.relu(nn.Dense(2 * WIDTH)(nn.LayerNorm()(h)))) * jax.nn.softmax(h) * mask, None


class Stacked(nn.Module):
    layers: int

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(WIDTH)(x)
        mask = (x[:, :1] > 0).astype(jnp.float32)
        blocks = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, in_axes=nn.broadcast,
                         length=self.layers)
        h, _ = blocks(name="blocks")(h, mask)
        return nn.Dense(2)(h)


def linen_loss(params, batch):
    return jnp.mean((Stacked(8).apply({"params": params}, batch["x"]) - batch["y"]) ** 2)


@pytest.mark.parametrize("stages, data, microbatches, repeats", [(4, 1, 4, 1), (2, 2, 2, 2)])
def test_an_unmodified_linen_scan_model_runs_its_stack_as_a_pipeline(stages, data, microbatches, repeats):
    rng = np.random.default_rng(1)
    batch = {"x": rng.normal(size=(ROWS, 3)).astype(np.float32), "y": rng.normal(size=(ROWS, 2)).astype(np.float32)}
    params = Stacked(8).init(jax.random.key(0), batch["x"])["params"]
    expected = jax.jit(jax.value_and_grad(linen_loss))(params, batch)
    mesh = Mesh(np.array(jax.devices()[:stages * data]).reshape(stages, data), ("stage", "data"))
    piped = pipelined(linen_loss, mesh=mesh, axis="stage", microbatches=microbatches, repeats=repeats)
    got = jax.jit(jax.value_and_grad(piped))(params, jax.device_put(batch, NamedSharding(mesh, P("data"))))
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-6)
    for path, value in jax.tree_util.tree_leaves_with_path(got[1]):
        want = jax.tree_util.tree_leaves_with_path(expected[1])
        np.testing.assert_allclose(value, dict(want)[path], rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_a_stack_inside_a_jitted_function_over_params_another_one_made_is_found():
    """Calls are opened on the way to a stack, and what they return is classified as inside them
    (here params only): the same stacks found at the batch's and at a microbatch's shape."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("stage",))
    cast = jax.jit(lambda w: jax.jit(lambda v: v * 1.0)(w))
    stack = jax.jit(lambda w, x: jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), x, w)[0])
    forward = lambda w, x: stack(cast(w), x).sum()
    w, x = jnp.ones((4, WIDTH, WIDTH)) / WIDTH, jnp.ones((ROWS, WIDTH))
    piped = pipelined(forward, mesh=mesh, axis="stage", microbatches=2)
    assert "collective_permute" in jax.jit(piped).lower(w, x).as_text()  # pipelined, not run as it was
    np.testing.assert_allclose(jax.jit(jax.grad(piped))(w, x), jax.grad(forward)(w, x), rtol=1e-5, atol=1e-6)


def test_layers_that_rematerialise_themselves_are_recomputed_once_with_their_inputs_kept():
    """A layer under ``jax.checkpoint`` (``nn.remat`` in a scan): by default each iteration keeps its
    input only, and the backward pass recomputes the iteration and the layer again inside it (5/4
    of the matmuls of the same stack without the checkpoint: the least memory); keeping each
    layer's input (``PipelineParallel(remat="layer")``) recomputes it once, the same stack's
    matmuls. The gradients are the stack's either way."""
    from parallax.pricing.fused_bytes import dot_flops

    mesh = Mesh(np.array(jax.devices()[:2]), ("stage",))
    w, x = jnp.ones((4, WIDTH, WIDTH)) / WIDTH, jnp.ones((ROWS, WIDTH))
    plain, remat = (lambda h, wl: jnp.tanh(h @ wl)), jax.checkpoint(lambda h, wl: jnp.tanh(h @ wl))
    flops = {}
    for name, layer, keep in (("plain", plain, False), ("iteration", remat, False), ("layer", remat, True)):
        forward = lambda w, x, layer=layer: jax.lax.scan(lambda h, wl: (layer(h, wl), None), x, w)[0].sum()
        gradient = jax.grad(pipelined(forward, mesh=mesh, axis="stage", microbatches=2, keep_layer_inputs=keep))
        flops[name] = sum(dot_flops(jax.make_jaxpr(gradient)(w, x).jaxpr))
        np.testing.assert_allclose(jax.jit(gradient)(w, x), jax.grad(forward)(w, x), rtol=1e-5, atol=1e-6)
    assert flops["layer"] == flops["plain"] and flops["iteration"] == 1.25 * flops["plain"], flops


def test_a_list_of_layers_that_rematerialise_themselves_keeps_each_ones_checkpoint_as_a_stack_does():
    """Layers called in turn, each under its own ``jax.checkpoint`` (a list of ``nn.remat`` blocks):
    each call's checkpoint is kept around the layer inside the pipeline, as a stack's scan keeps
    it: the same matmuls as the same layers stacked, in either mode, and ``jax.grad``'s gradients.
    (Before, the listed layers ran plainly inside the iteration's checkpoint: fewer matmuls, every
    layer's intermediates held at once while an iteration was recomputed.)"""
    from parallax.pricing.fused_bytes import dot_flops

    mesh = Mesh(np.array(jax.devices()[:2]), ("stage",))
    w, x = jnp.ones((4, WIDTH, WIDTH)) / WIDTH, jnp.ones((ROWS, WIDTH))
    layer = jax.checkpoint(lambda h, wl: jnp.tanh(jnp.tanh(h @ wl) @ wl))
    written = {"stacked": lambda w, x: jax.lax.scan(lambda h, wl: (layer(h, wl), None), x, w)[0].sum(),
               "listed": lambda w, x: functools.reduce(lambda h, wl: layer(h, wl), list(w), x).sum()}
    flops = {}
    for (name, forward), keep in itertools.product(written.items(), (False, True)):
        gradient = jax.grad(pipelined(forward, mesh=mesh, axis="stage", microbatches=2, keep_layer_inputs=keep))
        flops[name, keep] = sum(dot_flops(jax.make_jaxpr(gradient)(w, x).jaxpr))
        np.testing.assert_allclose(jax.jit(gradient)(w, x), jax.grad(forward)(w, x), rtol=1e-5, atol=1e-6)
    assert all(flops["listed", keep] == flops["stacked", keep] for keep in (False, True)), flops


def test_what_it_cannot_pipeline_is_an_error_naming_the_cause():
    mesh = Mesh(np.array(jax.devices()[:2]), ("stage",))
    x = jnp.ones((ROWS, WIDTH))
    rnn = lambda w, x: jax.lax.scan(  # a scan over time steps, not over layers
        lambda h, x_t: (jnp.tanh(h @ w + x_t), None), x, jnp.stack([x, 2 * x, 3 * x]))[0].sum()
    with pytest.raises(ValueError, match="No stack of blocks to pipeline"):
        pipelined(rnn, mesh=mesh, axis="stage", microbatches=2)(jnp.ones((WIDTH, WIDTH)), x)
    summed = lambda w, x: jax.lax.scan(
        lambda carry, wl: ((jnp.tanh(carry[0] @ wl), carry[1] + jnp.sum(wl)), None), (x, 0.0), w)[0]
    with pytest.raises(ValueError, match="carries a value that is not per example"):
        pipelined(summed, mesh=mesh, axis="stage", microbatches=2)(jnp.ones((4, WIDTH, WIDTH)), x)
    backwards = lambda w, x: jax.lax.scan(lambda h, wl: (h @ wl, None), x, w, reverse=True)[0]
    with pytest.raises(ValueError, match="reverse=True"):
        pipelined(backwards, mesh=mesh, axis="stage", microbatches=2)(jnp.ones((4, WIDTH, WIDTH)), x)


def stacked_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def stacked_batches(steps=3):
    rng = np.random.default_rng(2)
    return [{"x": rng.normal(size=(ROWS, 3)).astype(np.float32), "y": rng.normal(size=(ROWS, 2)).astype(np.float32)}
            for _ in range(steps)]


PIPELINES = {
    "pp4": lambda: px.PipelineParallel(4, microbatches=8),  # on 4 devices: the stage axis alone
    "dp4-pp2": lambda: px.combine(px.DataParallel(4), px.PipelineParallel(2, microbatches=4)),
    "pp2-fsdp4": lambda: px.combine(px.PipelineParallel(2), px.FSDP(4, min_weight_size=0)),
    "dp2-pp2-tp2": lambda: px.combine(px.DataParallel(2), px.PipelineParallel(2), px.TensorParallel(2)),
    "dp2-pp2circular-tp2": lambda: px.combine(px.DataParallel(2),
                                              px.PipelineParallel(2, schedule="circular", repeats=2),
                                              px.TensorParallel(2)),
}
EQUIVALENCE = ("pp4", "pp2-fsdp4", "dp2-pp2-tp2", "dp2-pp2circular-tp2")  # dp4-pp2: the layout and error tests


LINEN = [(name, optimizer) for name in EQUIVALENCE for optimizer in ("sgd", "adam")]


@pytest.mark.parametrize("name, optimizer", tiers.cases(LINEN, [(name, "adam") for name in EQUIVALENCE]))
def test_pipeline_parallel_trains_an_unmodified_linen_model_like_one_device(name, optimizer):
    """Against a plain one-device optax loop (``assert_equivalent``): losses, params, optimizer state."""
    tx = optax.sgd(0.1) if optimizer == "sgd" else optax.adam(1e-2)
    strategy = PIPELINES[name]()
    mesh = strategy.make_mesh(jax.devices()[:4]) if name == "pp4" else None
    report = px.testing.assert_equivalent(Stacked(8), tx, stacked_loss, stacked_batches(), strategy, mesh=mesh)
    assert report.mode == "jit" and report.max_diff <= 1e-5, report


@pytest.mark.wide("a remat policy inside the pipeline's iterations (23 s cold): the core tier pipelines without one")
def test_the_pipeline_iterations_keep_what_the_remat_policy_keeps_and_train_like_one_device():
    """Each iteration keeps its input and, with ``remat=("Block", dots_saveable)``, the matmuls'
    outputs: the step then has no more matmuls than with no ``remat`` at all (where the iterations
    ignored the policy, the backward pass recomputed the matmuls the blocks kept: 13 against 11),
    and the training is one device's."""
    strategy, batch = PIPELINES["pp2-fsdp4"](), stacked_batches(1)[0]
    dots = {}
    for remat in ((), ("Block", jax.checkpoint_policies.dots_saveable)):
        options = px.StepOptions(remat=remat)
        state = px.init_state(Stacked(8), optax.sgd(0.1), batch, strategy=strategy, loss_fn=stacked_loss,
                              options=options)
        text = px.make_train_step(stacked_loss, strategy, options).lower(state, batch).compile().as_text()
        dots[remat] = text.count(" dot(")
    assert dots[("Block", jax.checkpoint_policies.dots_saveable)] <= dots[()], dots
    report = px.testing.assert_equivalent(Stacked(8), optax.sgd(0.1), stacked_loss, stacked_batches(2), strategy,
                                          remat=("Block", jax.checkpoint_policies.dots_saveable))
    assert report.mode == "jit" and report.max_diff <= 1e-5, report


def test_each_stage_holds_its_layers_and_the_step_passes_activations_between_stages():
    strategy = px.Trainer(Stacked(8), optax.adam(1e-2), stacked_loss, strategy="pp2+fsdp").strategy  # by short name
    assert strategy == px.combine(px.PipelineParallel(2), px.FSDP())
    strategy = PIPELINES["pp2-fsdp4"]()
    batch = stacked_batches(1)[0]
    state = px.init_state(Stacked(8), optax.adam(1e-2), batch, strategy=strategy, loss_fn=stacked_loss)
    kernel = state.params["blocks"]["Dense_0"]["kernel"]  # (8 layers, 4, 8)
    assert kernel.sharding.spec[0] == "stage" and kernel.addressable_shards[0].data.shape[0] == 4
    assert state.opt_state[0].mu["blocks"]["Dense_0"]["kernel"].sharding.spec == kernel.sharding.spec
    step = px.make_train_step(stacked_loss, strategy)
    text = step.lower(state, batch).compile().as_text()
    assert "collective-permute" in text  # activations forward, and their cotangents back
    with pytest.raises(ValueError, match="runs the model's stack as a pipeline, which the jit path compiles"):
        px.make_train_step(stacked_loss, strategy, compile="shard_map").lower(state, batch)


UNEVEN = {  # layers the stages (× repeats) do not divide: the first groups one layer more
    ("stack", "pp4-fsdp2", "adam"): lambda: px.combine(px.PipelineParallel(4), px.FSDP(2, min_weight_size=0)),
    ("stack", "pp4-fsdp2", "sgd"): lambda: px.combine(px.PipelineParallel(4), px.FSDP(2, min_weight_size=0)),
    ("stack", "dp2-pp2circular-tp2", "adam"): lambda: px.combine(
        px.DataParallel(2), px.PipelineParallel(2, schedule="circular", repeats=2), px.TensorParallel(2)),
    ("gpt2", "pp2-fsdp4", "adamw"): lambda: px.combine(px.PipelineParallel(2), px.FSDP(4, min_weight_size=0)),
}


@pytest.mark.parametrize("model, layout, optimizer", tiers.cases(list(UNEVEN), [("stack", "pp4-fsdp2", "adam")]))
def test_layers_the_stages_do_not_divide_train_like_one_device_each_stage_holding_its_share(model, layout, optimizer):
    """A linen stack of 10 layers over 4 stages (3, 3, 2, 2; over 2 stages × 2 repeats: 3, 3, 2, 2 in
    groups) and Hugging Face GPT-2's 3 listed blocks over 2 stages (2, 1): against a plain one-device
    optax loop, the state split over the stages along another dim than the layers'."""
    from tests import third_party

    strategy = UNEVEN[model, layout, optimizer]()
    tx = {"adam": optax.adam(1e-2), "adamw": optax.adamw(1e-2), "sgd": optax.sgd(0.1)}[optimizer]
    if model == "gpt2":
        net, loss, batches = third_party.gpt2(layers=3), third_party.causal_lm_loss, third_party.batches("text", 3)
    else:
        net, loss, batches = Stacked(10), stacked_loss, stacked_batches()
    report = px.testing.assert_equivalent(net, tx, loss, batches, strategy)
    # held to 1e-5 (GPT-2: or twice the drift of plain jit on the mesh, as the other listed blocks)
    assert report.mode == "jit" and (model == "gpt2" or report.max_diff <= 1e-5), report
    if (model, layout, optimizer) == ("stack", "pp4-fsdp2", "adam"):
        from parallax.pricing.fused_bytes import dot_flops
        from parallax.state.candidate import abstract_batch

        plans = {layers: px.plan_state(Stacked(layers), tx, batches[0], strategy=strategy, loss_fn=loss)
                 for layers in (10, 12)}
        assert ("PipelineParallel(stage): 10 layers over 4 stages: 2 stages hold 3 layers, 2 hold 2; each stage runs "
                "3 layer slots per microbatch") in plans[10].describe_layout(), plans[10].describe_layout()
        kernel = plans[10].abstract_arrays().params["blocks"]["Dense_0"]["kernel"]  # (10 layers, 4, 8)
        assert kernel.sharding.spec[0] != "stage" and "stage" in kernel.sharding.spec, kernel.sharding
        # the stages split its 8
        assert np.prod(kernel.sharding.shard_shape(kernel.shape)) == np.prod(kernel.shape) // 8
        # Each stage runs 3 layer slots: the step's matmuls per device are 12 layers' over 4 stages, as px.plan
        # prices them (the jaxpr's FLOPs, pricing.fused_bytes.dot_flops).
        flops = {}
        for layers, built in plans.items():
            step = px.make_train_step(loss, built.strategy)
            batch = abstract_batch(batches[0], NamedSharding(built.mesh, P(built.strategy.batch_spec()[0])))
            flops[layers] = dot_flops(step.trace(built.abstract_arrays(), batch).jaxpr.jaxpr)[1]
        assert flops[10] == flops[12] > 0, flops


def test_a_pipeline_part_says_what_it_cannot_do():
    # microbatches=None: the most up to 2·stages that split the batch into microbatches divisible over the data shards
    assert px.PipelineParallel(2).run_change.microbatches_for(16, stages=2, data_shards=4) == 4
    with pytest.raises(ValueError, match=r"A batch of 6 rows cannot be split .* a batch size divisible by 8"):
        px.PipelineParallel(4, schedule="circular", repeats=2).run_change.microbatches_for(6, stages=4, data_shards=2)
    with pytest.raises(ValueError, match=r"GPipe holds one group of layers per stage \(repeats=1\)"):
        px.PipelineParallel(2, repeats=2)
    with pytest.raises(ValueError, match="schedule='1f1b'"):
        px.PipelineParallel(2, schedule="1f1b")
    with pytest.raises(ValueError, match="PipelineParallel found no stack of blocks in the model"):
        px.init_state(Flat(), optax.sgd(0.1), stacked_batches(1)[0], strategy=PIPELINES["dp4-pp2"](),
                      loss_fn=stacked_loss)
    with pytest.raises(ValueError, match=r"The stack has 8 layers, fewer than its 12 groups of layers \(stages × "
                                         r"repeats\): use at most 8"):
        px.init_state(Stacked(8), optax.sgd(0.1), stacked_batches(1)[0], loss_fn=stacked_loss,
                      strategy=px.combine(px.DataParallel(2), px.PipelineParallel(4, schedule="circular", repeats=3)))


class Flat(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2)(nn.Dense(WIDTH)(x))


class NormedBlock(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return nn.BatchNorm(use_running_average=False)(nn.Dense(WIDTH)(h)), None


class DroppingBlock(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return h + nn.Dropout(0.2, deterministic=False)(nn.Dense(WIDTH)(nn.LayerNorm()(h))), None


class StackOf(nn.Module):
    block: type
    variables: tuple = ("params",)
    split_dropout: bool = True  # a key per layer; False: every layer draws from one key (nn.scan's default)

    @nn.compact
    def __call__(self, x):
        blocks = nn.scan(self.block, variable_axes=dict.fromkeys(self.variables, 0),
                         split_rngs={"params": True, "dropout": self.split_dropout}, in_axes=nn.broadcast, length=4)
        return nn.Dense(2)(blocks()(nn.Dense(WIDTH)(x), None)[0])


def test_a_stack_a_pipeline_cannot_run_exactly_is_refused_before_compiling():
    with pytest.raises(ValueError, match="update state of their own"):
        px.init_state(StackOf(NormedBlock, ("params", "batch_stats")), optax.sgd(0.1), stacked_batches(1)[0],
                      strategy=PIPELINES["dp4-pp2"](), loss_fn=stacked_loss)


def dropout_loss(model, batch):
    """GPT-2's causal-LM loss with its dropout on (attention, residual and embedding dropout)."""
    from tests import third_party

    tokens = batch["tokens"][:, :-1]
    logits = model(tokens, tokens >= 0, third_party._positions(tokens), deterministic=False).logits
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()


DROPOUT = {  # blocks that draw random numbers: every mask is one device's
    "stack-remat-key-per-layer-pp4-adamw": lambda: (StackOf(nn.remat(DroppingBlock)), optax.adamw(1e-2),
                                                    PIPELINES["pp4"]()),  # the draws inside the block's checkpoint
    "stack-remat-layer-inputs-pp4-adamw": lambda: (StackOf(nn.remat(DroppingBlock)), optax.adamw(1e-2),
                                                   px.PipelineParallel(4, microbatches=8, remat="layer")),
    "stack-one-key-circular-sgd": lambda: (StackOf(DroppingBlock, split_dropout=False), optax.sgd(0.1),
                                           px.combine(px.DataParallel(4), px.PipelineParallel(
                                               2, schedule="circular", repeats=2, microbatches=2))),
    "nnx-scan-streams-dp4-pp2-sgd": lambda: (lambda: NnxStacked(4, nnx.Rngs(0, dropout=1), NnxDroppingBlock),
                                             optax.sgd(0.1), PIPELINES["dp4-pp2"]()),
    "list-key-each-pp2-fsdp4-sgd": lambda: (Keyed(), optax.sgd(0.1), px.combine(
        px.PipelineParallel(2, blocks="KeyedLayer"), px.FSDP(4, min_weight_size=0))),
    "list-layer-inputs-pp2-fsdp4-adamw": lambda: (Keyed(), optax.adamw(1e-2), px.combine(
        px.PipelineParallel(2, blocks="KeyedLayer", remat="layer"), px.FSDP(4, min_weight_size=0))),
    "gpt2-dropout-dp4-pp2-adamw": lambda: (hugging_face("gpt2", dropout=0.1)[0], optax.adamw(1e-2), px.combine(
        px.DataParallel(4), px.PipelineParallel(2, blocks="FlaxGPT2Block"))),
}
DROPOUT_CORE = ("stack-remat-key-per-layer-pp4-adamw", "stack-remat-layer-inputs-pp4-adamw",
                "list-layer-inputs-pp2-fsdp4-adamw", "nnx-scan-streams-dp4-pp2-sgd")


@pytest.mark.parametrize("case", [pytest.param(case, marks=[pytest.mark.wide(
    "an unmodified GPT-2 with its dropout on, against one device; the core tier pipelines GPT-2 without dropout"),
    pytest.mark.budget(40, "28-33 s cold: GPT-2 compiled whole and pipelined, each with AdamW")])
    if case.startswith("gpt2") else
    pytest.param(case, marks=[] if case in DROPOUT_CORE else [pytest.mark.wide(tiers.SECOND_OPTIMIZER)])
    for case in DROPOUT])
def test_blocks_that_draw_random_numbers_train_like_one_device_with_its_masks(case):
    """Dropout in a linen nn.scan (a key per layer, in nn.remat blocks; or one key every layer
    draws from), in an NNX nnx.scan whose blocks hold their own RNG streams, blocks given a key
    each, and an unmodified Hugging Face GPT-2 with its dropout on: against a plain one-device
    optax loop, so every mask is the one device's."""
    from tests import third_party

    model, tx, strategy = DROPOUT[case]()
    gpt2 = case.startswith("gpt2")
    mesh = strategy.make_mesh(jax.devices()[:4]) if "-pp4-" in case else None
    loss, batches = (dropout_loss, third_party.batches("text", 2)) if gpt2 else (stacked_loss, stacked_batches(2))
    report = px.testing.assert_equivalent(model, tx, loss, batches, strategy, mesh=mesh)
    assert report.mode == "jit", report


def test_a_random_draw_a_pipeline_cannot_make_as_one_device_is_named():
    mesh = Mesh(jax.devices()[:2], ("stage",))
    key, w, x = jax.random.key(0), jnp.ones((4, WIDTH, WIDTH)) / 3, jnp.ones((ROWS, WIDTH))

    def transposed(w, x):  # the batch is not the draw's leading dim
        drop = lambda h: h * jax.random.bernoulli(key, 0.5, h.shape[::-1]).T
        return jax.lax.scan(lambda h, wl: (drop(jnp.tanh(h @ wl)), None), x, w)[0].sum()

    def in_a_branch(w, x):  # drawn inside a cond
        drop = lambda h: jax.lax.cond(h.sum() > 0, lambda: h * jax.random.bernoulli(key, 0.5, h.shape),
                                      lambda: h)
        return jax.lax.scan(lambda h, wl: (drop(jnp.tanh(h @ wl)), None), x, w)[0].sum()

    with pytest.raises(ValueError, match=r"shape \(4, 16\) for the batch of 16 rows .* the batch is their leading dim"):
        pipelined(transposed, mesh=mesh, axis="stage", microbatches=2)(w, x)
    with pytest.raises(ValueError, match=r"per example inside a cond .* Draw them outside it"):
        pipelined(in_a_branch, mesh=mesh, axis="stage", microbatches=2)(w, x)


W_NNX = WIDTH


class NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(W_NNX, rngs=rngs)
        self.up, self.down = nnx.Linear(W_NNX, 2 * W_NNX, rngs=rngs), nnx.Linear(2 * W_NNX, W_NNX, rngs=rngs)

    def __call__(self, h):
        return h + self.down(nnx.gelu(self.up(self.norm(h))))


class NnxStacked(nnx.Module):
    """Blocks made with nnx.vmap and run with nnx.scan, as flax's docs stack them (each ``block``'s
    RNG streams, if it holds any, split per block)."""

    def __init__(self, layers, rngs, block=NnxBlock):
        self.embed, self.head = nnx.Linear(3, W_NNX, rngs=rngs), nnx.Linear(W_NNX, 2, rngs=rngs)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return block(rngs)

        self.blocks = make(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(h, block):
            return block(h)

        return self.head(run(self.embed(x), self.blocks))


class NnxDroppingBlock(nnx.Module):
    """A block with dropout holding its own RNG stream (stacked: one per block, nnx.split_rngs)."""

    def __init__(self, rngs):
        self.lin, self.drop = nnx.Linear(W_NNX, W_NNX, rngs=rngs), nnx.Dropout(0.2, rngs=rngs)

    def __call__(self, h):
        return h + self.drop(self.lin(h))


NNX_PIPELINES = {
    "dp2-pp4": lambda: px.combine(px.DataParallel(2), px.PipelineParallel(4)),
    "pp2-fsdp4": lambda: px.combine(px.PipelineParallel(2), px.FSDP(4, min_weight_size=0)),
}
NNX_GRID = [(name, optimizer) for name in NNX_PIPELINES for optimizer in ("sgd", "adam")]


@pytest.mark.parametrize("strategy, optimizer", tiers.cases(NNX_GRID, [(name, "adam") for name in NNX_PIPELINES]))
def test_pipeline_parallel_trains_an_nnx_scan_model_like_one_device(strategy, optimizer):
    tx = optax.sgd(0.02) if optimizer == "sgd" else optax.adam(1e-2)
    report = px.testing.assert_equivalent(lambda: NnxStacked(8, nnx.Rngs(0)), tx, stacked_loss, stacked_batches(),
                                          NNX_PIPELINES[strategy]())
    assert report.mode == "jit" and report.max_diff <= 1e-5, report


CHECKPOINTED = {  # the model, and the pipelines its first and last runs train under
    "stack": (lambda: Stacked(8), lambda: px.combine(px.DataParallel(2), px.PipelineParallel(4)),
              lambda: px.combine(px.PipelineParallel(2), px.FSDP(4, min_weight_size=0))),
    "linen-list": (lambda: LinenListed(),
                   lambda: px.combine(px.DataParallel(4), px.PipelineParallel(2, blocks="ListedDense")),
                   lambda: px.combine(px.PipelineParallel(2, schedule="circular", repeats=2, blocks="ListedDense"),
                                      px.FSDP(4, min_weight_size=0))),
    "list": (lambda: (lambda: NnxListed(nnx.Rngs(0))),
             lambda: px.combine(px.DataParallel(4), px.PipelineParallel(2, blocks=ListedLayer)),
             lambda: px.combine(px.PipelineParallel(2, schedule="circular", repeats=2, blocks="ListedLayer"),
                                px.FSDP(4, min_weight_size=0))),
}


@pytest.mark.wide("checkpoints resumed across layouts (18-20 s cold each); the Trainer's checkpoints are in the "
                  "core tier")
@pytest.mark.parametrize("kind", sorted(CHECKPOINTED))
def test_a_checkpoint_written_under_a_pipeline_resumes_without_it_and_on_other_stages(tmp_path, kind):
    """The Trainer's checkpoints hold the stack in the model's own layout ([layers, ...]; a list of
    blocks as the list, a linen list held stacked by the pipelines too): a pipeline for 2 steps →
    DataParallel(8) for 2 → another pipeline × FSDP(4) for 2, against one device for 6."""
    rng = np.random.default_rng(3)
    data = {"x": rng.normal(size=(96, 3)).astype(np.float32), "y": rng.normal(size=(96, 2)).astype(np.float32)}
    model, first, last = CHECKPOINTED[kind]

    def fit(strategy, steps, resume=True, **options):
        trainer = px.Trainer(model(), optax.adam(1e-2), stacked_loss, strategy=strategy, max_steps=steps,
                             batch_size=16, progress=False, **options)
        return trainer.fit(data, resume=resume)

    saving = dict(checkpoint_dir=str(tmp_path), checkpoint_every=2)
    runs = [fit(first(), 2, resume=False, **saving), fit(px.DataParallel(8), 4, **saving), fit(last(), 6, **saving)]
    one = fit(px.DataParallel(1), 6, resume=False, devices=jax.devices()[:1])
    losses = [h["loss"] for run in runs for h in run.history.train]
    np.testing.assert_allclose(losses, [h["loss"] for h in one.history.train], atol=1e-5, rtol=0)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=0),
                 jax.device_get(runs[-1].state.variables["params"]), jax.device_get(one.state.params))
    if kind == "linen-list":  # held stacked under both pipelines
        assert isinstance(runs[0].state.params, StackedBlocks) and isinstance(runs[-1].state.params, StackedBlocks)


class LinenListed(nn.Module):
    """Four blocks listed beside the layers before and after them (a linen module's own children)."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(WIDTH)(x)
        for _ in range(4):
            h = ListedDense()(h)
        return nn.Dense(2)(h)


# A list of identical blocks called in turn (no scan in the trace): Hugging Face's Flax GPT-2 and
# Llama as the transformers package builds them, four layers, named by their block class.
def hugging_face(name, dropout=0.0):
    from tests import third_party

    if name == "gpt2":
        return third_party.gpt2(layers=4, dropout=dropout), "FlaxGPT2Block"
    return third_party.llama(layers=4), "FlaxLlamaDecoderLayer"


LISTED = {  # every strategy of the grid, each model with both optimizers; the core case names no blocks (found)
    ("gpt2", "pp4", "sgd"): lambda b: px.PipelineParallel(4, microbatches=8, blocks=b),
    ("gpt2", "pp2-fsdp4", "adamw"): lambda b: px.combine(px.PipelineParallel(2), px.FSDP(4, min_weight_size=0)),
    ("llama", "dp2-pp2-tp2", "sgd"): lambda b: px.combine(px.DataParallel(2), px.PipelineParallel(2, blocks=b),
                                                          px.TensorParallel(2)),
    ("llama", "dp2-pp2circular-tp2", "adamw"): lambda b: px.combine(
        px.DataParallel(2), px.PipelineParallel(2, schedule="circular", repeats=2, blocks=b), px.TensorParallel(2)),
}


@pytest.mark.parametrize("name, layout, optimizer", tiers.cases(list(LISTED), [("gpt2", "pp2-fsdp4", "adamw")]))
def test_a_list_of_blocks_in_an_unmodified_hugging_face_model_trains_like_one_device(name, layout, optimizer, caplog):
    from tests import third_party

    model, block = hugging_face(name)
    strategy = LISTED[name, layout, optimizer](block)
    mesh = strategy.make_mesh(jax.devices()[:4]) if layout == "pp4" else None
    tx = optax.sgd(0.1) if optimizer == "sgd" else optax.adamw(1e-2)
    with caplog.at_level(logging.INFO, logger="parallax"):
        report = px.testing.assert_equivalent(model, tx, third_party.causal_lm_loss, third_party.batches("text", 3),
                                              strategy, mesh=mesh)
    assert report.mode == "jit", report  # held to 1e-5, or twice the drift of plain jit on the mesh
    if any(getattr(part, "blocks", "") is None for part in strategy.parts):  # the model's one block class, found
        found = f"it calls one block class at several places, {block}, pipelined as blocks kept in a list"
        assert found in caplog.text, caplog.text[-3000:]
        assert f"blocks='{block}'" in report.strategy, report.strategy


class TwoKinds(nn.Module):
    """Two block classes, each called twice: which are the blocks is for the user to say."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(WIDTH)(x)
        for _ in range(2):
            h = ListedDense()(h)
        for _ in range(2):
            h = OtherDense()(h)
        return nn.Dense(2)(h)


class ListedDense(nn.Module):
    @nn.compact
    def __call__(self, h):
        return h + nn.Dense(WIDTH)(h)


class OtherDense(ListedDense):
    pass


def test_a_pipeline_over_a_list_names_the_block_classes_it_could_be():
    with pytest.raises(ValueError, match=r"no stack of blocks in the model.* The model calls ListedDense, OtherDense "
                                         r"at several places: .* PipelineParallel\(blocks='ListedDense'\)"):
        px.init_state(TwoKinds(), optax.sgd(0.1), stacked_batches(1)[0], loss_fn=stacked_loss,
                      strategy=px.combine(px.DataParallel(4), px.PipelineParallel(2)))


class ListedLayer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up, self.down = nnx.Linear(WIDTH, 8, rngs=rngs), nnx.Linear(8, WIDTH, rngs=rngs)

    def __call__(self, x, scale):
        return x + self.down(jnp.tanh(self.up(x) * scale))


class NnxListed(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed, self.head = nnx.Linear(3, WIDTH, rngs=rngs), nnx.Linear(WIDTH, 2, rngs=rngs)
        self.layers = nnx.List([ListedLayer(rngs) for _ in range(4)])

    def __call__(self, x):
        h, scale = self.embed(x), 1.0 + 0.1 * jnp.abs(x[:, :1])  # a per-example value every layer reads
        for layer in self.layers:
            h = layer(h, scale)
        return self.head(h)


def test_an_nnx_list_of_blocks_trains_like_one_device_and_each_stage_holds_its_share():
    strategy = px.combine(px.PipelineParallel(2, schedule="circular", repeats=2, blocks=ListedLayer),
                          px.FSDP(4, min_weight_size=0))
    px.testing.assert_equivalent(lambda: NnxListed(nnx.Rngs(0)), optax.adam(1e-2), stacked_loss, stacked_batches(),
                                 strategy)
    state = px.init_state(lambda: NnxListed(nnx.Rngs(0)), optax.adam(1e-2), stacked_batches(1)[0], strategy=strategy,
                          loss_fn=stacked_loss)
    kernel = state.params["layers"][0]["up"]["kernel"]  # (4, 8): the model's own tree, split over both axes
    assert set(kernel.sharding.spec) == {"stage", "fsdp"} and kernel.addressable_shards[0].data.size == kernel.size // 8
    assert state.params["embed"]["kernel"].sharding.spec[0] != "stage"  # only the listed blocks go to the stages


def test_the_state_holds_the_listed_blocks_stacked_by_stage_and_the_step_moves_only_activations(caplog):
    """GPT-2's four listed blocks under PP 2 × DP 4: the state holds them stacked ``[4, ...]``, the layer
    dim over the stages (each device two blocks whole, their Adam moments alike), and the compiled
    step moves no params between stages (no all-to-all, with the params cast to bfloat16 too: the
    restack of ``stack_blocks=False``, kept as it was, sends each stage the other half of its blocks
    every step). An optimizer that scales each
    param by its own norm (LAMB) would update the stacked rows otherwise: the blocks then stay in
    the model's tree, said in the log, and it still trains like one device."""
    from tests import third_party

    model, block = hugging_face("gpt2")
    batches = third_party.batches("text", 2)
    strategy = px.combine(px.DataParallel(4), px.PipelineParallel(2, blocks=block))
    state = px.init_state(model, optax.adamw(1e-2), batches[0], strategy=strategy, loss_fn=third_party.causal_lm_loss)
    held = state.params["transformer"]["h"]
    assert isinstance(held, StackedBlocks) and list(held) == ["0", "1", "2", "3"]
    kernel = held.stacked["attn"]["c_attn"]["kernel"]
    assert kernel.shape == (4, 96, 32) and kernel.sharding.spec[0] == "stage"
    assert kernel.addressable_shards[0].data.shape == (2, 96, 32)  # two blocks, whole
    mu = state.opt_state[0].mu["transformer"]["h"].stacked["attn"]["c_attn"]["kernel"]
    assert mu.sharding.spec == kernel.sharding.spec
    np.testing.assert_array_equal(held["2"]["attn"]["c_attn"]["kernel"], kernel[2])  # reads as the model's tree
    assert state.module() is not None  # bound to the blocks as the model writes them
    step = px.make_train_step(third_party.causal_lm_loss, strategy)
    text = step.lower(state, batches[0]).compile().as_text()
    assert "collective-permute" in text and "all-to-all" not in text, "the blocks' params moved between stages"
    bf16 = px.make_train_step(third_party.causal_lm_loss, strategy, precision="bf16")  # the rows cast, still in place
    assert "all-to-all" not in bf16.lower(state, batches[0]).compile().as_text()
    restacking = px.combine(px.DataParallel(4), px.PipelineParallel(2, blocks=block, stack_blocks=False))
    listed = px.init_state(model, optax.sgd(0.1), batches[0], strategy=restacking, loss_fn=third_party.causal_lm_loss)
    for leaf in jax.tree.leaves(listed.params["transformer"]["h"]["1"]):  # the model's own tree, half on each stage
        assert "stage" in leaf.sharding.spec and leaf.addressable_shards[0].data.size == leaf.size // 2
    again = px.make_train_step(third_party.causal_lm_loss, restacking).lower(listed, batches[0]).compile().as_text()
    assert "all-to-all" in again
    with caplog.at_level(logging.WARNING, logger="parallax"):
        px.testing.assert_equivalent(model, optax.lamb(1e-2), third_party.causal_lm_loss, batches, strategy)
    assert "scales each by its own norm" in caplog.text, caplog.text[-2000:]


@pytest.mark.parametrize("blocks, dropout, loss, message", [
    ("FlaxGPT2Attention", 0.0, None, "found no blocks of that class called in turn"),
    ("FlaxGPT2Block", 0.0, "hidden_states", "reads a block's output besides the next block"),
])
def test_blocks_a_pipeline_cannot_run_are_named_before_compiling(blocks, dropout, loss, message):
    from tests import third_party

    model, _ = hugging_face("gpt2", dropout=dropout)

    def every_layer(model, batch):  # reads each block's output: what a pipeline cannot return
        tokens = batch["tokens"][:, :-1]
        out = model(tokens, tokens >= 0, third_party._positions(tokens), deterministic=loss != "dropout",
                    output_hidden_states=loss == "hidden_states")
        per_layer = sum(h.mean() for h in out.hidden_states) if loss == "hidden_states" else 0.0
        return optax.softmax_cross_entropy_with_integer_labels(out.logits, batch["tokens"][:, 1:]).mean() + per_layer

    with pytest.raises(ValueError, match=message):
        px.init_state(model, optax.sgd(0.1), third_party.batches("text", 1)[0], loss_fn=every_layer,
                      strategy=px.combine(px.DataParallel(4), px.PipelineParallel(2, blocks=blocks)))


class KeyedLayer(nn.Module):
    @nn.compact
    def __call__(self, h, key):
        return h + nn.Dense(WIDTH)(h) * jax.random.uniform(key, h.shape)


class Keyed(nn.Module):
    """Each block given a random key of its own, drawn outside the blocks."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(WIDTH)(x)
        for index in range(4):
            h = KeyedLayer()(h, jax.random.fold_in(jax.random.key(0), index))
        return nn.Dense(2)(h)


@pytest.mark.wide("the search of strategy='auto' over pipelines (two searches, about 25 s cold)")
def test_auto_prices_the_pipelines_over_a_stack_and_none_without_blocks():
    """A stack gets its pipelines priced beside the other meshes (its blocks rematerialising themselves:
    also the pipeline keeping each block's input, a program of its own); a model without blocks (stacked
    or listed: tests/test_auto.py), none."""
    from parallax.state.search import resolve

    def priced(model):
        found = resolve(model, optax.sgd(0.1), stacked_batches(1)[0], "auto", loss_fn=stacked_loss,
                        devices=jax.devices()[:2])
        return sorted(found.choice.estimates)

    labels = priced(StackOf(nn.remat(DroppingBlock)))
    assert sorted({label.split(",")[0] for label in labels if "remat=" not in label}) == [
        "DataParallel(data=2)", "FSDP(fsdp=2)", "PipelineParallel(stage=2)"], labels
    assert not any(label.startswith("PipelineParallel") for label in priced(Flat()))
    pipelines = [label for label in labels if label.startswith("PipelineParallel")]
    assert len(pipelines) == 2 and sum("remat='layer'" in label for label in pipelines) == 1, pipelines


@pytest.mark.wide("a Llama-shaped model stacked and listed, compiled and trained; the core tier checks the same "
                  "checkpoints on plain layers (test_a_list_of_layers_that_rematerialise_themselves_...)")
@pytest.mark.budget(50, "the model stacked and listed, each traced and compiled under PP × FSDP, and the listed one "
                        "trained against one device: 35-45 s cold")
def test_a_list_of_blocks_that_rematerialise_themselves_pipelines_at_the_cost_of_the_same_blocks_stacked():
    """A Hugging Face–style list of ``nn.remat`` blocks (``benchmarks/llama.py``'s ``ListedLlama``,
    its blocks found, not named) under ``PipelineParallel(2) × FSDP(4)``: each block keeps its own
    checkpoint inside the pipeline, as the same blocks in an ``nn.scan`` do, so the step has the
    stack's matmuls, and its peak exceeds the stack's by no more than the copy of the blocks' params
    the list's step stacks for the pipeline (each device's share); and it trains like one device.
    (Before, each block ran plainly inside the iteration's checkpoint: here 0.84× the matmuls.)"""
    from benchmarks.llama import ListedLlama, Llama, Shape, listed_params, loss_fn
    from parallax.pricing.fused_bytes import dot_flops

    shape = Shape(layers=4, dim=32, ffn=64, heads=4, kv_heads=2, vocab=64, dtype="float32")
    rng = np.random.default_rng(0)
    batches = [{"tokens": rng.integers(0, shape.vocab, size=(8, 17)).astype(np.int32)} for _ in range(2)]
    stacked = Llama(shape).init(jax.random.key(0), batches[0]["tokens"][:, :-1])["params"]
    listed = listed_params(stacked, shape.layers)
    strategy = px.combine(px.PipelineParallel(2, microbatches=4), px.FSDP(4, min_weight_size=0, split="largest"))
    cost = {}
    for written, model, params in (("stacked", Llama(shape), stacked), ("listed", ListedLlama(shape), listed)):
        state = px.init_state(model, optax.adamw(1e-2), batches[0], strategy=strategy, loss_fn=loss_fn, params=params)
        traced = px.make_train_step(loss_fn, strategy, compile="jit").trace(
            state, jax.device_put(batches[0], NamedSharding(strategy.make_mesh(), strategy.batch_spec())))
        whole, local = dot_flops(traced.jaxpr.jaxpr)
        cost[written] = (whole / jax.device_count() + local,
                         px.inspect.peak_bytes(px.inspect.memory_bytes(traced.lower().compile())))
    restacked = sum(x.nbytes for x in jax.tree.leaves(stacked["layers"])) / jax.device_count()
    (stacked_flops, stacked_peak), (listed_flops, listed_peak) = cost["stacked"], cost["listed"]
    assert listed_flops == stacked_flops and listed_peak - stacked_peak <= 1.2 * restacked, (cost, restacked)
    report = px.testing.assert_equivalent(ListedLlama(shape), optax.adamw(1e-2), loss_fn, batches, strategy,
                                          params=listed)
    assert report.mode == "jit", report


@pytest.mark.wide("GPT-2 pipelined over microbatches of one row, against one device (~5 s)")
def test_microbatches_of_one_row_pipeline_an_attention_model_like_one_device():
    """Hugging Face GPT-2's listed blocks over 2 stages × DP 4, 16 rows in microbatches of one: the
    layer's proof reads the microbatch's trace, where the example dim has one row (a reshape onto a
    unit dim, a causal mask ``jnp.broadcast_to`` leaves as it is). It was refused as mixing examples."""
    from tests import third_party

    strategy = px.combine(px.PipelineParallel(2, microbatches=16), px.DataParallel(4))
    report = px.testing.assert_equivalent(third_party.gpt2(layers=2), optax.adamw(1e-2), third_party.causal_lm_loss,
                                          third_party.batches("text", 2), strategy)
    assert report.mode == "jit", report


SEEN_BY_THE_BLOCK: list = []  # the meshes KernelBlock was traced under (its test reads them)


class KernelBlock(nn.Module):
    """Causal self-attention by jax's Pallas flash-attention kernel (the interpreter runs it on this CPU),
    placed by the model itself as MaxText places its kernels: under a mesh, per device in a ``shard_map``
    over the axes it may split, the rows over the FSDP axis."""

    @nn.compact
    def __call__(self, h, _):
        from jax.experimental.pallas.ops.gpu import attention

        q, k, v = (nn.DenseGeneral((2, 8), use_bias=False)(h) for _ in range(3))  # a key bias: zero gradient
        kernel = functools.partial(attention.mha, segment_ids=None, causal=True, interpret=True)
        mesh = jax.sharding.get_abstract_mesh()
        SEEN_BY_THE_BLOCK.append(mesh)
        if mesh.empty:
            out = kernel(q, k, v)
        else:
            free = {a for a in mesh.axis_names if a not in mesh.manual_axes}
            spec = P("fsdp" if "fsdp" in free else None)
            out = jax.shard_map(kernel, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, axis_names=free,
                                check_vma=False)(q, k, v)
        return h + nn.DenseGeneral(WIDTH, axis=(-2, -1))(out), None


class KernelStack(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        h = nn.Embed(32, WIDTH)(tokens)
        h, _ = nn.scan(KernelBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                       length=4)(name="blocks")(h, None)
        return nn.Dense(32)(h)


@pytest.mark.wide("a pipeline over a Pallas kernel its interpreter runs (9 s cold); the core tier proves such a kernel "
                  "per example in test_per_example_proof.py")
def test_a_stack_whose_attention_is_a_pallas_kernel_in_its_own_shard_map_is_pipelined_like_one_device():
    """The per-example proof reads a Pallas kernel by its grid (each cell one example: jax's flash attention
    takes one row a cell), so a stack calling one is pipelined over microbatches, exact against one device
    (refused before: "it applies pallas_call, which the proof does not know"). The layer is traced under the
    mesh it runs in, the stage axis manual: a model that places its own ``shard_map`` by the mesh in context
    places it there too (traced with no mesh before, it ran the kernel unplaced, and on GPUs XLA gathered
    its operands whole on every device: 1.1 GB of all-gathers on a small Llama, PP 2 × FSDP 2 × TP 2)."""
    def loss(model, batch):
        logits = model(batch["tokens"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()

    rng = np.random.default_rng(3)
    batches = [{"tokens": rng.integers(0, 32, (16, 9)).astype(np.int32)} for _ in range(2)]  # 4 rows a microbatch
    strategy = px.combine(px.PipelineParallel(2, microbatches=4), px.FSDP(4, min_weight_size=0))
    SEEN_BY_THE_BLOCK.clear()
    report = px.testing.assert_equivalent(KernelStack(), optax.adam(1e-2), loss, batches, strategy)
    assert report.max_diff <= 1e-5, report
    in_the_pipeline = [m for m in SEEN_BY_THE_BLOCK if "stage" in m.manual_axes]
    assert in_the_pipeline and all(set(m.axis_names) == {"stage", "fsdp"} for m in in_the_pipeline)
