"""Involuntary full rematerialization: read from the compiler, named in the step, absent or named
on the test models (the third-party models' runs check it too, ``tests/test_third_party.py``)."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import parallax as px
from parallax.step.resharding import compile_reporting, parse, suspects
from tests.models import MODELS, batches
from tests.reference import assert_named

pytestmark = pytest.mark.core

SHARDY = ("W spmd_partitioner.cc:656] [SPMD] Involuntary full rematerialization. The compiler cannot go from "
          "sharding {mesh['data'=2,'fsdp'=4], [{'data', 'fsdp'}, {}, {}]} to {mesh['data'=2,'fsdp'=4], [{}, {}, "
          "{'fsdp'}]} efficiently for HLO operation %fake_parameter.2 = f32[2,8,32]{2,1,0} parameter(2). As the "
          "last resort, SPMD will replicate the tensor and then partition it")


def test_a_replicating_reshard_is_read_from_the_compiler_with_the_params_that_ask_for_it(fresh_compiles, capfd):
    """From batch split over (data, fsdp) to features split over fsdp: the partitioner replicates."""
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    x = jax.device_put(jnp.ones((16, 32)), NamedSharding(mesh, P(("data", "fsdp"))))
    to_features = NamedSharding(mesh, P(None, "fsdp"))
    f = jax.jit(lambda x: jax.lax.with_sharding_constraint(x * 2, to_features) + 1)
    compiled, found = compile_reporting(f.lower(x), {"w": jnp.ones((32, 64)), "v": jnp.ones((16, 16))},
                                        {"w": P("fsdp", None), "v": P(None, "fsdp")}, mesh)
    assert len(found) == 1, found
    assert found[0].shape == "f32[2,32]" and found[0].suspects == ("w",), found[0]
    assert float(compiled(x).sum()) == 16 * 32 * 3  # the program is the compiled one, and right
    # The same program again, already compiled in this process: nothing new to report.
    assert compile_reporting(f.lower(x))[1] == []
    assert "Involuntary" not in capfd.readouterr().err  # parallax's warning names it; the compiler's lines are held
    logger = logging.getLogger("parallax")
    level, g = logger.level, jax.jit(lambda x: jax.lax.with_sharding_constraint(x * 3, to_features) - 1)
    logger.setLevel(logging.DEBUG)  # asked for: the compiler's own words reach stderr
    try:
        assert len(compile_reporting(g.lower(x))[1]) == 1
    finally:
        logger.setLevel(level)
    assert "Involuntary" in capfd.readouterr().err


def test_shardy_and_gspmd_wordings_are_both_read():
    (found,) = parse(SHARDY)
    assert found.shape == "f32[2,8,32]" and found.op == "fake_parameter.2"
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"))
    params = {"embed": jnp.ones((16, 32)), "kernel": jnp.ones((32, 64)), "bias": jnp.ones((64,))}
    specs = {"embed": P(None, "fsdp"), "kernel": P(None, "fsdp"), "bias": P()}
    assert suspects(found, params, specs, mesh) == ("embed",)  # 32 split 4 ways; the kernel splits its 64
    assert parse("nothing to see") == []


@pytest.mark.wide("every layout of three models compiled without the cache to read the compiler's report (65 s cold)")
@pytest.mark.budget(75, "every layout the defaults and hybrids give the three test models, compiled without the "
                        "cache to read the compiler's report")
def test_every_default_and_hybrid_on_the_test_models_is_free_of_it_or_names_it(fresh_compiles, caplog):
    """Each of the step's compiled paths: no replicating reshard, or one the step names (the op or
    the params that ask for it) in describe() and a warning. The one-axis defaults have none. FSDP's
    default split is the search's pick: every split it may pick is checked."""
    fsdp = lambda size, split: px.FSDP(size, min_weight_size=256, split=split)
    strategies = {"dp": px.DataParallel(), "tp": px.TensorParallel()}
    for split in ("largest", "output", "input"):
        strategies |= {
            f"fsdp {split}": fsdp(-1, split), f"dp+fsdp {split}": px.combine(px.DataParallel(2), fsdp(4, split)),
            f"fsdp+tp {split}": px.combine(fsdp(4, split), px.TensorParallel(2)),
            f"dp+fsdp+tp {split}": px.combine(px.DataParallel(2), fsdp(2, split), px.TensorParallel(2))}
    caplog.set_level(logging.WARNING, logger="parallax")
    seen = {}
    for model_name, (model, loss_fn) in MODELS.items():
        batch = batches(model_name, 1)[0]
        layouts = {}
        for name, strategy in strategies.items():
            # Compiling needs the state's shapes and shardings, not its values: the planned state.
            plan = px.plan_state(model(), optax.adam(1e-3), batch, strategy=strategy, loss_fn=loss_fn)
            arrays = plan.abstract_arrays()
            layout = (name.split()[0], tuple(str(leaf.sharding.spec) for leaf in jax.tree.leaves(arrays.params)))
            if layout in layouts:  # another split laid this model's params out alike: the same programs
                seen[model_name, name] = seen[model_name, layouts[layout]]
                continue
            layouts[layout] = name
            step = px.make_train_step(loss_fn, strategy, compile="jit" if "+" in name else "auto")
            step.lower(arrays, px.data.to_global(batch, NamedSharding(plan.mesh, strategy.batch_spec())))
            seen[model_name, name] = {path: len(found) for path, found in step.reshardings.items()}
            for path, found in step.reshardings.items():
                if "+" not in name:
                    assert not found, (model_name, name, path, [r.describe() for r in found])
                for resharding in found:
                    assert resharding.suspects or "/" in resharding.op, resharding  # named: params or a JAX op path
            assert_named(step, caplog.text)
    print(seen)

