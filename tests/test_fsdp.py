"""FSDP keeps 1/N of every large param and moment per device, from init on."""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import parallax as px
from tests.models import TinyLM, batches, classifier_loss, lm_loss

pytestmark = pytest.mark.core

MIN_SIZE = 1024


def _local_shape(array):
    shapes = {tuple(s.data.shape) for s in array.addressable_shards}
    assert len(shapes) == 1
    return shapes.pop()


def test_each_device_holds_one_eighth_of_large_params_and_moments():
    model = TinyLM(vocab=128, features=64)
    strategy = px.FSDP(min_weight_size=MIN_SIZE, split="largest")
    state = px.init_state(model, optax.adamw(1e-3), batches("lm", 1)[0], strategy=strategy, loss_fn=lm_loss)
    adam = state.opt_state[0]
    flat = jax.tree_util.tree_flatten_with_path(state.params)[0]
    sharded = 0
    for (path, param), mu, nu in zip(flat, jax.tree.leaves(adam.mu), jax.tree.leaves(adam.nu)):
        name = jax.tree_util.keystr(path)
        local = _local_shape(param)
        if param.size > MIN_SIZE:
            sharded += 1
            assert np.prod(local) * 8 == param.size, (name, param.shape, local)
            split = [d for d in range(param.ndim) if local[d] != param.shape[d]]
            assert len(split) == 1 and local[split[0]] * 8 == param.shape[split[0]], name
        else:
            assert local == param.shape, name
        assert _local_shape(mu) == local and _local_shape(nu) == local, name
    assert sharded >= 5  # embedding, q/k/v/out, up, down, head
    assert _local_shape(adam.count) == ()


class Wide(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4096, name="wide")(x)  # 1024 x 4096 float32 = 16 MiB


def test_init_never_materialises_a_whole_param_on_one_device():
    strategy = px.FSDP(min_weight_size=0, split="largest")
    plan = px.plan_state(Wide(), optax.sgd(0.1), jnp.ones((8, 1024)), strategy=strategy)
    full_bytes = 1024 * 4096 * 4
    lowered = plan.lower()
    compiled = lowered.compile()
    memory = compiled.memory_analysis()
    # The output is this device's shard; no buffer of the whole kernel's shape exists.
    assert memory.output_size_in_bytes < full_bytes / 8 + 4096, memory
    assert memory.temp_size_in_bytes < full_bytes, memory
    assert "[1024,4096]" not in compiled.as_text()
    kernel = plan.build().params["wide"]["kernel"]
    assert kernel.sharding.spec == P(None, "fsdp") and _local_shape(kernel) == (1024, 512)


def test_wrap_runs_the_notebook_recipe_inside_shard_map():
    """px.wrap_for_shard_map: shard on write at init, gather on read, inside the user's shard_map."""
    model = TinyLM(vocab=64, features=32)
    strategy = px.FSDP(min_weight_size=256, split="largest")
    mesh = strategy.make_mesh()
    wrapped = px.wrap_for_shard_map(model, strategy)
    tokens = batches("lm", 1)[0]["x"]

    def local_init(x):
        return wrapped.init(jax.random.PRNGKey(0), x, train=False)

    local = jax.eval_shape(jax.shard_map(local_init, mesh=mesh, in_specs=P("fsdp"), out_specs=P(),
                                         check_vma=False), tokens)
    kernel = local["params"]["block"]["up"]["kernel"]
    assert isinstance(kernel, nn.Partitioned) and kernel.names == (None, "fsdp")
    assert kernel.value.shape == (32, 16)  # this device's eighth of (32, 128)
    init = jax.jit(jax.shard_map(local_init, mesh=mesh, in_specs=P("fsdp"),
                                 out_specs=nn.get_partition_spec(local), check_vma=False))
    sharded = nn.unbox(init(tokens))
    expected = model.init(jax.random.PRNGKey(0), tokens, train=False)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
                 jax.device_get(sharded), jax.device_get(expected))


def test_wrapped_module_matches_the_unwrapped_one():
    model = TinyLM(vocab=64, features=32)
    strategy = px.FSDP(min_weight_size=256, split="largest")
    mesh = strategy.make_mesh()
    tokens = batches("lm", 1)[0]["x"]
    variables = model.init(jax.random.PRNGKey(0), tokens, train=False)
    expected = model.apply(variables, tokens, train=False)
    specs = strategy.param_specs(variables["params"], mesh)
    boxed = jax.tree.map(lambda v, s: nn.Partitioned(v, tuple(s) + (None,) * (v.ndim - len(s))) if len(s) else v,
                         variables["params"], specs, is_leaf=px.specs.is_spec)
    boxed_specs = nn.get_partition_spec(boxed)
    wrapped = px.wrap_for_shard_map(model, strategy)
    apply = jax.jit(jax.shard_map(lambda p, x: wrapped.apply({"params": p}, x, train=False), mesh=mesh,
                                  in_specs=(boxed_specs, P("fsdp")), out_specs=P("fsdp"), check_vma=False))
    np.testing.assert_allclose(apply(boxed, tokens), expected, atol=1e-5)


def test_split_chooses_the_output_or_input_dim_where_it_divides():
    model, batch = TinyLM(vocab=128, features=64), batches("lm", 1)[0]
    shapes = {jax.tree_util.keystr(p): x.shape for p, x in jax.tree_util.tree_flatten_with_path(
        jax.eval_shape(lambda: model.init(jax.random.key(0), batch["x"])["params"]))[0]}
    for split, preferred in (("output", -1), ("input", -2)):
        strategy = px.FSDP(min_weight_size=MIN_SIZE, split=split)
        specs = px.plan_state(model, optax.sgd(0.1), batch, strategy=strategy, loss_fn=lm_loss).specs.params
        split_dims = {jax.tree_util.keystr(p): list(spec).index("fsdp") if "fsdp" in spec else None
                      for p, spec in jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))[0]}
        for path, shape in shapes.items():
            if np.prod(shape) <= MIN_SIZE:
                assert split_dims[path] is None, (split, path)
            elif len(shape) > 1 and shape[preferred] % 8 == 0:
                assert split_dims[path] == len(shape) + preferred, (split, path, shape, split_dims[path])
        assert sum(d is not None for d in split_dims.values()) >= 5
    assert px.FSDP(split="input").dim_order((3, 3, 64, 128)) == [2, 3, 0, 1]
    assert px.FSDP(split="output").dim_order((512,)) == [0]


@pytest.mark.wide("five equivalence runs, each split on each path (39 s cold); FSDP's default split trains against "
                  "one device in the core tier (tests/test_equivalence.py)")
@pytest.mark.budget(60, "five equivalence runs: each split on each compile path, and a hybrid")
def test_every_split_trains_like_one_device():
    """Each split is a correct plan: against an independent one-device loop (px.testing), on both paths."""
    model, data = TinyLM(vocab=64, features=32), batches("lm", 4, batch_size=16)
    for split, tx, compile in (("output", optax.sgd(0.1), "jit"), ("input", optax.sgd(0.1), "jit"),
                               ("output", optax.adamw(3e-3), "shard_map"), ("input", optax.adamw(3e-3), "shard_map")):
        report = px.testing.assert_equivalent(model, tx, px.per_example_loss(lm_loss), data,
                                              px.FSDP(min_weight_size=256, split=split), compile=compile)
        assert report.mode == compile
    hybrid = px.combine(px.DataParallel(2), px.FSDP(4, min_weight_size=256, split="output"))
    px.testing.assert_equivalent(model, optax.adamw(3e-3), lm_loss, data, hybrid)


def test_a_bad_split_is_a_clear_error():
    with pytest.raises(ValueError, match=r"FSDP\(split='rows'\): use 'largest', 'output' .*, 'input' or 'auto'"):
        px.FSDP(split="rows")


class Narrowing(nn.Module):
    """Dense 24 → 96 → 48 → 10: its biases stay whole under FSDP (each below min_weight_size)."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.relu(nn.Dense(96)(x))
        return nn.Dense(10)(nn.relu(nn.Dense(48)(x)))


def test_the_jit_path_updates_an_unsplit_param_where_it_lives():
    """Gradients are laid out as their params, so a whole bias is updated whole on every device:
    no all-gather brings the bias or Adam's moments back after a split update (at most one
    collective of a bias's shape: its gradient's). Left to infer it, the partitioner split those
    updates under FSDP's output split and all-gathered three arrays per bias."""
    strategy = px.FSDP(min_weight_size=1024, split="output")
    batch = batches("mlp", 1, 64)[0]
    state = px.init_state(Narrowing(), optax.adam(1e-3), batch, strategy=strategy, loss_fn=classifier_loss)
    specs = {jax.tree_util.keystr(path): leaf.sharding.spec for path, leaf in
             jax.tree_util.tree_leaves_with_path(state.params)}
    assert all(spec == P() for name, spec in specs.items() if "bias" in name), specs
    assert sum(spec != P() for spec in specs.values()) == 2, specs  # the two larger kernels are split
    step = px.make_train_step(classifier_loss, strategy, compile="jit")
    mesh = jax.tree.leaves(state.params)[0].sharding.mesh
    placed = px.data.to_global(batch, jax.sharding.NamedSharding(mesh, strategy.batch_spec()))
    hlo = step.lower(state, placed).compile().as_text()
    for width in (96, 48):
        gathers = re.findall(rf"= f32\[{width}\]\{{0\}} all-gather(?:-start)?\(", hlo)
        assert len(gathers) <= 1, (width, len(gathers))
