"""TensorParallel with no rules reads the Megatron layout from the computation.

The specs are asserted (which dim of which param is split over the tensor axis), and the
models that are not already in the equivalence grid (scanned and rematerialised layers,
kernels stored ``(out, in)``) train exactly like one device under TP hybrids.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import parallax as px
from tests import tiers
from tests.models import CNN, classifier_loss
from tests.reference import OPTIMIZERS, bound, drift_floor, params_bound, run_plain, run_steps

pytestmark = pytest.mark.core

TP2 = lambda: px.combine(px.DataParallel(4), px.TensorParallel(2))


class AutoMLP(nn.Module):
    """Auto-named layers: Dense_0..2 and an ``out`` head (no Megatron names anywhere)."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        for _ in range(3):
            x = nn.relu(nn.Dense(32)(x))
        return nn.Dense(10, name="out")(x)


class OutInDense(nn.Module):
    """A PyTorch-style linear: the kernel is stored ``(out, in)`` and applied as ``x @ w.T``."""

    features: int

    @nn.compact
    def __call__(self, x):
        w = self.param("weight", nn.initializers.lecun_normal(), (self.features, x.shape[-1]))
        return x @ w.T + self.param("bias", nn.initializers.zeros, (self.features,))


class OutInMLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        h = nn.gelu(OutInDense(48, name="fc1")(x))
        return OutInDense(10, name="fc2")(h)


class ScanLayer(nn.Module):
    hidden: int

    @nn.compact
    def __call__(self, x, _):
        h = nn.relu(nn.Dense(self.hidden, name="up")(x))
        return x + nn.Dense(x.shape[-1], name="down")(h), None


class ScannedMLP(nn.Module):
    """Residual MLP layers under ``nn.scan`` (params stacked on a leading layer dim), remat'd."""

    layers: int = 3
    features: int = 16
    hidden: int = 32

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Dense(self.features, name="embed")(x)
        layers = nn.scan(nn.remat(ScanLayer), variable_axes={"params": 0}, split_rngs={"params": True},
                         length=self.layers)
        x, _ = layers(self.hidden, name="layers")(x, None)
        return nn.Dense(10, name="head")(x)


class OddHeads(nn.Module):
    """Attention with 3 heads of 3 features (neither divisible by 2) next to an MLP whose hidden dim is."""

    heads: int = 3

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads, qkv_features=9, out_features=x.shape[-1],
                                                name="attn")(x)
        x = x + nn.Dense(x.shape[-1], name="down")(nn.relu(nn.Dense(64, name="up")(x)))
        return nn.Dense(10, name="head")(x.mean(axis=1))


def _data(shape, steps=6, seed=0):
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(size=shape).astype(np.float32), "y": rng.integers(0, 10, shape[0]).astype(np.int32)}
            for _ in range(steps)]


def _plan(model, batch, strategy, loss_fn=classifier_loss):
    return px.plan_state(model, optax.sgd(0.1), batch, strategy=strategy, loss_fn=loss_fn)


def _tensor_specs(plan):
    """Path -> PartitionSpec of the params that use the tensor axis."""
    flat = jax.tree_util.tree_flatten_with_path(plan.specs.params, is_leaf=px.specs.is_spec)[0]
    return {px.specs.path_str(k): s for k, s in flat if "tensor" in px.specs.dims_axes(list(s))}


def test_auto_named_mlp_is_split_megatron_style():
    plan = _plan(AutoMLP(), _data((16, 24))[0], TP2())
    assert _tensor_specs(plan) == {
        "Dense_0/kernel": P(None, "tensor"), "Dense_0/bias": P("tensor"),  # column
        "Dense_1/kernel": P("tensor"),                                      # row
        "Dense_2/kernel": P(None, "tensor"), "Dense_2/bias": P("tensor"),  # column
        "out/kernel": P("tensor"),                                          # row
    }
    text = plan.describe_layout()
    assert "Dense_1/kernel" in text and "row" in text and "column" in text, text


def test_cnn_is_split_megatron_style():
    plan = _plan(CNN(), _data((16, 8, 8, 1))[0], TP2())
    assert _tensor_specs(plan) == {
        "Conv_0/kernel": P(None, None, None, "tensor"), "BatchNorm_0/scale": P("tensor"),
        "BatchNorm_0/bias": P("tensor"),                                    # conv column + its BatchNorm
        "Conv_1/kernel": P(None, None, "tensor"),                           # conv row
        "head/kernel": P(None, "tensor"), "head/bias": P("tensor"),        # class logits, column
    }


def test_out_in_kernels_are_paired_by_use_not_by_storage():
    plan = _plan(OutInMLP(), _data((16, 24))[0], TP2())
    assert _tensor_specs(plan) == {"fc1/weight": P("tensor"), "fc1/bias": P("tensor"), "fc2/weight": P(None, "tensor")}


def test_scanned_layers_split_a_feature_dim_never_the_layer_dim():
    plan = _plan(ScannedMLP(), _data((16, 24))[0], TP2())
    specs = _tensor_specs(plan)
    assert specs["layers/up/kernel"] == P(None, None, "tensor"), specs  # (layers, in, hidden): hidden
    assert specs["layers/down/kernel"] == P(None, "tensor"), specs      # (layers, hidden, out): hidden
    assert "a scanned layer dim (nn.scan)" in plan.describe_layout()  # why the layer dim stays whole


def test_fsdp_never_splits_the_scanned_layer_dim():
    # 8 layers of 8x8 kernels: the layer dim is as large as any other and comes first.
    plan = _plan(ScannedMLP(layers=8, features=8, hidden=8), _data((16, 24))[0],
                 px.FSDP(min_weight_size=0, split="largest"))
    assert plan.specs.params["layers"]["up"]["kernel"] == P(None, "fsdp")
    assert plan.specs.params["layers"]["up"]["bias"] == P(None, "fsdp")


def test_heads_not_divisible_still_splits_the_mlp_and_says_why():
    plan = _plan(OddHeads(), _data((8, 4, 16))[0], TP2())
    specs = _tensor_specs(plan)
    assert specs["up/kernel"] == P(None, "tensor") and specs["down/kernel"] == P("tensor"), specs
    assert not any(path.startswith("attn/") for path in specs), specs
    text = plan.describe_layout()
    assert "which the axis size 2 does not divide" in text, text


def test_too_little_split_is_an_error_naming_the_reason():
    class OnlyOddHeads(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = True):
            x = nn.MultiHeadDotProductAttention(num_heads=3, qkv_features=9, out_features=9, name="attn")(x)
            return nn.Dense(5, name="head", use_bias=False)(x.mean(axis=1))

    def loss_fn(model, batch):
        return (model(batch["x"]) ** 2).mean()

    batch = _data((8, 4, 9))[0]
    with pytest.raises(ValueError,
                       match=r"(?s)found a layout for only 0.0%.*attn/.*does not divide.*min_split_fraction=0"):
        _plan(OnlyOddHeads(), batch, TP2(), loss_fn)
    plan = _plan(OnlyOddHeads(), batch, px.combine(px.DataParallel(4), px.TensorParallel(2, min_split_fraction=0)),
                 loss_fn)
    assert plan.found.of(plan.strategy.parts[1]) is not None


def test_rules_override_and_the_rest_is_derived():
    strategy = px.combine(px.DataParallel(4), px.TensorParallel(2, rules=[(r"^out/kernel$", "replicate")]))
    specs = _tensor_specs(_plan(AutoMLP(), _data((16, 24))[0], strategy))
    assert "out/kernel" not in specs and specs["Dense_0/kernel"] == P(None, "tensor"), specs
    names_only = px.combine(px.DataParallel(4), px.TensorParallel(2, rules=[(r"Dense_2/kernel$", "row")], derive=False))
    assert _tensor_specs(_plan(AutoMLP(), _data((16, 24))[0], names_only)) == {"Dense_2/kernel": P("tensor")}


def test_param_specs_without_the_computation_says_how_to_get_them():
    with pytest.raises(ValueError, match=r"derives its layout from the model's computation.*plan_state"):
        px.TensorParallel().param_specs({"Dense_0": {"kernel": jnp.ones((8, 8))}})


@functools.cache
def _reference(name, opt_name):
    model, shape = MODELS[name]
    data = _data(shape)
    single = px.DataParallel(1)
    state = px.init_state(model, OPTIMIZERS[opt_name](), data[0], strategy=single, rng=0, loss_fn=classifier_loss,
                          mesh=single.make_mesh(jax.devices()[:1]))
    return jax.device_get(state.params), run_plain(model, OPTIMIZERS[opt_name](), classifier_loss, state, data)


MODELS = {"scanned": (ScannedMLP(), (16, 24)), "out_in": (OutInMLP(), (16, 24))}
HYBRIDS = {
    "fsdp+tp": lambda: px.combine(px.FSDP(4, min_weight_size=64, split="largest"), px.TensorParallel(2)),
    "dp+fsdp+tp": lambda: px.combine(px.DataParallel(2), px.FSDP(2, min_weight_size=64, split="largest"),
                                     px.TensorParallel(2)),
}


LAYOUT_GRID = [(name, s, o) for name in sorted(MODELS) for s in sorted(HYBRIDS) for o in sorted(OPTIMIZERS)]


@pytest.mark.parametrize("name, strategy_name, opt_name", tiers.cases(
    LAYOUT_GRID, [case for case in LAYOUT_GRID if case[2] == "adamw"]))
def test_derived_layout_trains_like_one_device(name, strategy_name, opt_name):
    model, shape = MODELS[name]
    data = _data(shape)
    init_params, ref = _reference(name, opt_name)
    strategy = HYBRIDS[strategy_name]()

    def start():  # the step donates its input state: each run gets its own
        return px.init_state(model, OPTIMIZERS[opt_name](), data[0], strategy=strategy, rng=0,
                             loss_fn=classifier_loss, params=init_params)

    state, losses = run_steps(px.make_train_step(classifier_loss, strategy), start(), data)
    diff = float(np.abs(losses - ref.losses).max())
    floor = functools.cache(lambda: drift_floor(model, OPTIMIZERS[opt_name](), classifier_loss, start(), data, strategy,
                                                ref))
    params_diff, params_tol = params_bound(jax.device_get(state.params), ref, floor)
    print(f"{name}/{strategy_name}/{opt_name}: loss diff {diff:.2e}, final params diff {params_diff:.2e}")
    assert diff <= bound(diff, lambda: floor().losses)
    assert params_diff <= params_tol
