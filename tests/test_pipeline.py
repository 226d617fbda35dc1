"""The pipeline schedule (``parallax.models.pipeline``) against a plain ``lax.scan`` on one device.

The layer divides by the mean of its input, so the zeros a stage sees in its bubble (before its
first microbatch arrives) give NaN there: any of it reaching an output or a gradient fails.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from parallax.models.pipeline import pipeline

WIDTH, ROWS = 4, 16


def layer(w, h, c):
    return jnp.tanh(h @ w["kernel"] + w["bias"]) * c["scale"] + h / jnp.mean(h, axis=-1, keepdims=True)


def values(layers, seed=0):
    rng = np.random.default_rng(seed)
    weights = {"kernel": rng.uniform(0.1, 0.5, (layers, WIDTH, WIDTH)).astype(np.float32),
               "bias": rng.uniform(0.0, 0.1, (layers, WIDTH)).astype(np.float32)}
    inputs = rng.uniform(0.5, 1.5, (ROWS, WIDTH)).astype(np.float32)
    constants = {"scale": rng.uniform(0.5, 1.0, (ROWS, 1)).astype(np.float32)}
    cotangent = rng.normal(size=(ROWS, WIDTH)).astype(np.float32)
    return weights, inputs, constants, cotangent


def one_device(weights, inputs, constants, cotangent):
    def loss(w, x, c):
        out = jax.lax.scan(lambda h, wl: (layer(wl, h, c), None), x, w)[0]
        return jnp.sum(out * cotangent), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(weights, inputs, constants)
    return out, grads


@pytest.mark.parametrize("stages, microbatches, repeats, per_stage, data", [
    (2, 2, 1, 2, 1),  # GPipe, two layers a stage
    (4, 8, 1, 1, 2),  # more microbatches than stages, beside a data axis
    (2, 2, 2, 1, 1),  # circular, as many microbatches as stages
    (4, 8, 2, 1, 1),  # circular, more microbatches than stages
    (2, 4, 2, 2, 2),  # circular, two layers a group, beside a data axis
])
def test_the_pipeline_computes_the_stack_and_its_gradients(stages, microbatches, repeats, per_stage, data):
    layers = stages * repeats * per_stage
    weights, inputs, constants, cotangent = values(layers)
    expected, expected_grads = one_device(weights, inputs, constants, cotangent)
    mesh = Mesh(np.array(jax.devices()[:stages * data]).reshape(stages, data), ("stage", "data"))

    def loss(w, x, c):
        out = pipeline(layer, w, x, c, mesh=mesh, axis="stage", microbatches=microbatches, repeats=repeats)
        return jnp.sum(out * cotangent), out

    place = lambda tree, spec: jax.device_put(tree, NamedSharding(mesh, spec))  # noqa: E731
    args = (place(weights, P("stage")), place(inputs, P("data")), place(constants, P("data")))
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(*args)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("stages, microbatches, repeats, layers, rows, message", [
    (2, 2, 1, 3, 16, "3 layers, which 2 stages × repeats=1 do not divide"),
    (2, 2, 2, 6, 16, "6 layers, which 2 stages × repeats=2 do not divide"),
    (2, 3, 1, 4, 16, "microbatches=3 does not divide the batch of 16 rows"),
    (4, 2, 2, 8, 16, "microbatches=2 < 4 stages; use microbatches >= 4"),
])
def test_a_stack_it_cannot_pipeline_is_an_error_naming_the_value(stages, microbatches, repeats, layers, rows, message):
    mesh = Mesh(np.array(jax.devices()[:stages]), ("stage",))
    weights = {"kernel": jnp.ones((layers, WIDTH, WIDTH)), "bias": jnp.ones((layers, WIDTH))}
    with pytest.raises(ValueError, match=message):
        pipeline(layer, weights, jnp.ones((rows, WIDTH)), {"scale": jnp.ones((rows, 1))}, mesh=mesh, axis="stage",
                 microbatches=microbatches, repeats=repeats)
