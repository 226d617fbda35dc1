"""A pytest plugin that plants one of ``tests/test_testing.py``'s bugs in the library for a whole run,
to show that the core tier (``make test``) fails with it (tests/README.md: the tiers)::

    PARALLAX_PLANT=summed .venv/bin/python -m pytest -p tests.scripts.plant_bug --tier core tests/test_equivalence.py

``PARALLAX_PLANT`` is one of ``summed`` (a gradient summed instead of averaged over a data axis),
``batchnorm`` (BatchNorm statistics per shard), ``dropout`` (one dropout key on every data shard),
``neighbour`` (an FSDP shard updated with another shard's gradient), ``bf16`` (updates rounded to
bfloat16 before they are added).
"""

from __future__ import annotations

import os
import types

import jax
import jax.numpy as jnp


def _summed():
    pmean = jax.lax.pmean

    def summed_over_data(x, axis_name, **kwargs):
        names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
        return jax.lax.psum(x, axis_name) if "data" in names else pmean(x, axis_name, **kwargs)

    jax.lax.pmean = summed_over_data


def _batchnorm():
    from parallax.step import shard_map as shard_map_step

    model_run = shard_map_step.ModelRun
    shard_map_step.ModelRun = lambda **kwargs: model_run(**{**kwargs, "batch_stats_axes": None})


def _dropout():
    jax.lax.axis_index = lambda axis_name: jnp.int32(0)


def _neighbour():
    from parallax.sharding import gather as gather_lib

    def neighbours_gradient(axis_name, dim, _, grad):
        size = jax.lax.axis_size(axis_name)
        mean = jax.lax.psum_scatter(grad, axis_name, scatter_dimension=dim, tiled=True) / size
        return (jax.lax.ppermute(mean, axis_name, [(i, (i + 1) % size) for i in range(size)]),)

    gather_lib.all_gather_mean_grad.defvjp(gather_lib._gather_fwd, neighbours_gradient)


def bf16_updates(params, updates):
    """``optax.apply_updates`` with each update rounded to bfloat16 first (the ``bf16`` bug; the tests plant it too)."""
    return jax.tree.map(lambda p, u: p + u.astype(jnp.bfloat16).astype(p.dtype), params, updates)


def _bf16():
    from parallax.step import update

    update.optax = types.SimpleNamespace(apply_updates=bf16_updates)


PLANTS = {"summed": _summed, "batchnorm": _batchnorm, "dropout": _dropout, "neighbour": _neighbour, "bf16": _bf16}


def pytest_configure(config):
    name = os.environ.get("PARALLAX_PLANT", "")
    if name not in PLANTS:
        raise ValueError(f"PARALLAX_PLANT={name!r}: one of {sorted(PLANTS)}")
    PLANTS[name]()


def pytest_report_header(config):
    return f"planted bug: {os.environ.get('PARALLAX_PLANT')}"
