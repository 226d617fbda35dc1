"""Placement rules as constant tables: pure functions of path, shape and strategy."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import parallax as px
from parallax.sharding.specs import place_param

pytestmark = pytest.mark.core

FSDP8 = {"fsdp": 8}


@pytest.mark.parametrize(
    "path, shape, min_size, expected",
    [
        ("Dense_0/kernel", (1024, 512), 0, P("fsdp")),
        ("Dense_0/kernel", (7, 1024), 0, P(None, "fsdp")),  # largest divisible dim
        ("Dense_0/kernel", (512, 512), 0, P("fsdp")),  # a tie takes the first dim
        ("Dense_0/kernel", (1023, 7), 0, P()),  # no dim divisible: replicated
        ("Dense_0/bias", (10,), 0, P()),
        ("Dense_0/bias", (64,), 64, P()),  # not larger than min_weight_size
        ("Dense_0/bias", (72,), 64, P("fsdp")),
        ("moe/experts/up/kernel", (4, 32, 128), 0, P(None, None, "fsdp")),
    ],
)
def test_fsdp_placement(path, shape, min_size, expected):
    assert place_param(path, shape, [px.FSDP(min_weight_size=min_size)], FSDP8) == expected


TP4 = {"tensor": 4}


@pytest.mark.parametrize(
    "path, shape, expected",
    [
        ("block/attn/query/kernel", (32, 4, 8), P(None, "tensor")),  # heads split
        ("block/attn/query/bias", (4, 8), P("tensor")),
        ("block/attn/value/kernel", (32, 4, 8), P(None, "tensor")),
        ("block/attn/out/kernel", (4, 8, 32), P("tensor")),  # row: heads split
        ("block/attn/out/bias", (32,), P()),  # added after the reduction
        ("block/mlp/up/kernel", (32, 128), P(None, "tensor")),
        ("block/mlp/up/bias", (128,), P("tensor")),
        ("block/mlp/down/kernel", (128, 32), P("tensor")),
        ("h_0/mlp/c_fc/kernel", (32, 128), P(None, "tensor")),
        ("mlp/up_1/kernel", (32, 128), P(None, "tensor")),  # numbered names
        ("mlp/down_12/kernel", (128, 32), P("tensor")),
        ("mlp/upper/kernel", (32, 128), P()),  # but not other words
        ("h_0/mlp/c_proj/kernel", (128, 32), P("tensor")),
        ("layers.0.self_attn/q_proj/kernel", (32, 32), P(None, "tensor")),  # dots in names
        ("layers.0.self_attn/k_proj/kernel", (32, 2, 16), P()),  # 2 grouped KV heads, 4 shards
        ("embed/embedding", (64, 32), P("tensor")),  # vocab split
        ("embed/embedding", (65, 32), P(None, "tensor")),  # vocab indivisible: features
        ("output/kernel", (32, 10), P()),  # 'out' is a whole component, not a prefix
        ("head/kernel", (32, 64), P()),
        ("LayerNorm_0/scale", (32,), P()),
    ],
)
def test_tensor_parallel_default_rules(path, shape, expected):
    assert place_param(path, shape, [px.TensorParallel(derive=False)], TP4) == expected


def test_fsdp_and_tensor_compose():
    parts = px.combine(px.FSDP(min_weight_size=0), px.TensorParallel(derive=False)).parts
    sizes = {"fsdp": 2, "tensor": 4}
    assert place_param("mlp/up/kernel", (64, 256), parts, sizes) == P("fsdp", "tensor")
    assert place_param("mlp/down/kernel", (256, 64), parts, sizes) == P("tensor", "fsdp")
    assert place_param("mlp/up/bias", (256,), parts, sizes) == P("tensor")  # fsdp has no dim left


def test_user_rules_and_explicit_specs():
    tp = px.TensorParallel(rules=[(r"linear/weight$", P("tensor", None)),  # PyTorch-style (out, in)
                                  (r"experts/up/kernel$", P(None, None, "tensor"))], derive=False)
    assert place_param("block/linear/weight", (128, 32), [tp], TP4) == P("tensor")
    assert place_param("moe/experts/up/kernel", (4, 32, 128), [tp], TP4) == P(None, None, "tensor")
    assert place_param("block/attn/query/kernel", (32, 4, 8), [tp], TP4) == P()  # defaults replaced


def test_annotations_are_kept_and_composed():
    parts = px.combine(px.FSDP(min_weight_size=0), px.TensorParallel(derive=False)).parts
    sizes = {"fsdp": 2, "tensor": 4}
    # The model says "split dim 0 over tensor": kept (rules do not override it); FSDP takes dim 1.
    box = nn.Partitioned(jax.ShapeDtypeStruct((64, 256), jnp.float32), ("tensor", None))
    assert place_param("mlp/up/kernel", (64, 256), parts, sizes, box=box) == P("tensor", "fsdp")
    # Names of another mesh are ignored; logical names resolve through their rules.
    box = nn.Partitioned(jax.ShapeDtypeStruct((64, 256), jnp.float32), ("model", None))
    assert place_param("x/kernel", (64, 256), parts, sizes, box=box) == P(None, "fsdp")
    box = nn.LogicallyPartitioned(jax.ShapeDtypeStruct((64, 256), jnp.float32), ("embed", "mlp"),
                                  rules=(("embed", "fsdp"), ("mlp", "tensor")))
    assert place_param("x/kernel", (64, 256), parts, sizes, box=box) == P("fsdp", "tensor")


class Annotated(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "tensor"))
        x = nn.Dense(256, kernel_init=init, name="proj_in")(x)
        return nn.Dense(8, name="out")(x)


def test_state_specs_cover_optimizer_and_annotations():
    strategy = px.combine(px.FSDP(2, min_weight_size=0), px.TensorParallel(4, rules=[(r"^out/kernel$", "row")]))
    plan = px.plan_state(Annotated(), optax.adamw(1e-3), jnp.ones((8, 64)), strategy=strategy)
    specs = plan.specs
    assert specs.params["proj_in"]["kernel"] == P("fsdp", "tensor")  # annotation + FSDP
    assert specs.params["out"]["kernel"] == P("tensor", "fsdp")
    adam = specs.opt_state[0]
    assert adam.mu["proj_in"]["kernel"] == P("fsdp", "tensor")
    assert adam.nu["out"]["kernel"] == P("tensor", "fsdp")
    assert adam.count == P()
    assert specs.step == P() and specs.rng == P()
    state = plan.build()
    assert state.params["proj_in"]["kernel"].sharding.spec == P("fsdp", "tensor")


def test_batch_spec_covers_every_data_axis():
    assert px.DataParallel().batch_spec() == P("data")
    assert px.TensorParallel().batch_spec() == P()
    strategy = px.combine(px.DataParallel(2), px.FSDP(2), px.TensorParallel(2))
    assert strategy.batch_spec() == P(("data", "fsdp"))
    mesh = strategy.make_mesh()
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
