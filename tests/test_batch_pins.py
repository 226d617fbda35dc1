"""The batch's split kept through a scanned stack (``parallax.step.batch_pins``): each device computes
its share of the matmuls, against the compiler's own count, and trains as one device."""

from __future__ import annotations

import jax
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import parallax as px
from parallax.pricing.cost import program_costs
from parallax.pricing.fused_bytes import dot_flops
from parallax.state.candidate import abstract_batch

pytestmark = pytest.mark.core


def _llama(layers=2):
    from benchmarks.llama import SHAPES, Llama

    return Llama(SHAPES["8b"]._replace(layers=layers, dim=128, ffn=256, heads=4, kv_heads=2, vocab=256), remat=False)


def test_fsdp_over_a_scanned_stack_computes_each_devices_share_of_the_matmuls():
    """A scanned Llama under FSDP 8: the compiled step's FLOPs per device (XLA's count, with every loop
    iteration's matmuls) against the jaxpr's global matmul FLOPs over 8. Left to the compiler the loop's
    body kept the weights in place and computed the whole batch's activations on every device (1.73× a
    device's share at dim 512; 2.8× for Llama 3.1 8B at sequence 8192); the list of the same blocks, 1.02×."""
    from benchmarks.llama import batch, loss_fn

    strategy = px.FSDP(8, min_weight_size=0)
    mesh = strategy.make_mesh(jax.devices()[:8])
    shapes = batch(16, 64)
    plan = px.plan_state(_llama(), optax.adamw(1e-3), shapes, strategy=strategy, loss_fn=loss_fn, mesh=mesh)
    step = px.make_train_step(loss_fn, strategy, compile="jit")
    args = (plan.abstract_arrays(), abstract_batch(shapes, NamedSharding(mesh, P("fsdp"))))
    whole, _ = dot_flops(step.trace(*args).jaxpr.jaxpr)
    compiled = step.lower(*args).compile()
    per_device = program_costs(compiled, compiled.as_text())[0]  # matmuls and the elementwise work besides
    assert whole / 8 <= per_device < 1.15 * whole / 8, per_device / (whole / 8)


def test_a_scanned_stack_under_fsdp_with_its_batch_pinned_trains_like_one_device():
    from benchmarks.llama import loss_fn
    from tests import third_party

    tokens = [{"tokens": b["tokens"] % 256} for b in third_party.batches("text", 3)]
    report = px.testing.assert_equivalent(_llama(), optax.adamw(1e-2), loss_fn, tokens, px.FSDP(8, min_weight_size=0))
    # within bf16's rounding (the model computes in bf16), as assert_equivalent holds
    assert report.mode == "jit", report
