"""The performance zoo's smallest members (``benchmarks/zoo_models.py``) train like one device.

The zoo is where the defaults are measured for speed (``benchmarks/zoo.py``); here its linen
members, shrunk (widths x0.25), the smallest of each family (MLP, transformer LM, CNN with
BatchNorm, mixture of experts) and the ``nn.scan``-stacked LM, run under every strategy of the
zoo against a plain one-device optax loop from the same initial variables: SGD under each
strategy (it shows a wrong gradient scale, which Adam hides), AdamW under FSDP (params and
optimizer state split). Every run compiles with ``jit``, one compile each (the
``shard_map`` path is checked on these shapes' kin in ``tests/test_equivalence.py`` and
``tests/test_third_party.py``). The zoo's NNX members are twins of these networks; NNX itself
is checked in ``tests/test_nnx.py``.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

import parallax as px
from benchmarks.zoo_models import zoo
from tests import tiers
from tests.reference import OPTIMIZERS, assert_like_reference, drift_floor, run_plain, run_steps

pytestmark = pytest.mark.core

STEPS = 2
MIN = 256  # FSDP splits params above this many elements (the shrunk zoo's kernels)
# FSDP's split as its default search picked it for the member's FSDP kind in the zoo's run
# (benchmarks/results/zoo.md): the splits a user's run trains, not only the largest dim.
SPLIT = {"mlp_square_b": "output", "lm_0": "input", "lm_scan": "input", "cnn_0": "output", "moe": "input"}
STRATEGIES = {
    "dp": lambda split: px.DataParallel(),
    "fsdp": lambda split: px.FSDP(min_weight_size=MIN, split=split),
    "tp": lambda split: px.TensorParallel(),
    "dp+fsdp": lambda split: px.combine(px.DataParallel(2), px.FSDP(4, min_weight_size=MIN, split=split)),
    "fsdp+tp": lambda split: px.combine(px.FSDP(4, min_weight_size=MIN, split=split), px.TensorParallel(2)),
}
GRID = [(s, "sgd") for s in STRATEGIES] + [("fsdp", "adamw")]


def _params(member) -> int:
    shapes = jax.eval_shape(lambda: member.build().init(jax.random.key(0), member.batch["x"][:1]))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes["params"]))


@functools.cache
def members() -> dict:
    """The smallest linen member of each family, and the scanned LM, at a quarter of the widths."""
    linen = [m for m in zoo(0, scale=0.25) if m.api == "linen"]
    chosen = {m.name: m for m in linen if m.name == "lm_scan"}
    for family in sorted({m.family for m in linen}):
        smallest = min((m for m in linen if m.family == family), key=_params)
        chosen[smallest.name] = smallest
    return chosen


@functools.cache
def reference(name: str, opt_name: str):
    member = members()[name]
    single = px.DataParallel(1)
    state = px.init_state(member.build(), OPTIMIZERS[opt_name](), member.batch, strategy=single, rng=0,
                          loss_fn=member.loss_fn, mesh=single.make_mesh(jax.devices()[:1]))
    data = [member.batch] * STEPS
    return jax.device_get(state.params), run_plain(member.build(), OPTIMIZERS[opt_name](), member.loss_fn, state, data)


def test_the_smallest_members_are_one_per_family_and_the_scanned_lm():
    assert sorted(m.family for m in members().values()) == ["cnn", "lm", "lm", "mlp", "moe"]
    assert "lm_scan" in members()


CASES = [(name, s, o) for name in ["mlp_square_b", "lm_0", "lm_scan", "cnn_0", "moe"] for s, o in GRID]
# The core tier: FSDP with AdamW on the square MLP and the MoE (the linen family's grid is test_equivalence.py's).
CORE = [("mlp_square_b", "fsdp", "adamw"), ("moe", "fsdp", "adamw")]


@pytest.mark.parametrize("name, strategy_name, opt_name", tiers.cases(CASES, CORE))
def test_zoo_member_trains_like_one_device(name, strategy_name, opt_name):
    member = members().get(name)
    assert member is not None, f"{name} is no longer among the smallest: {sorted(members())}"
    init_params, ref = reference(name, opt_name)
    strategy = STRATEGIES[strategy_name](SPLIT[name])
    data = [member.batch] * STEPS

    def start():
        return px.init_state(member.build(), OPTIMIZERS[opt_name](), member.batch, strategy=strategy, rng=0,
                             loss_fn=member.loss_fn, params=init_params)

    state, losses = run_steps(px.make_train_step(member.loss_fn, strategy, compile="jit"), start(), data)
    floor = functools.cache(lambda: drift_floor(member.build(), OPTIMIZERS[opt_name](), member.loss_fn, start(), data,
                                                strategy, ref))
    assert_like_reference(f"{name}/{strategy_name}/{opt_name}", jax.device_get(state.params), losses, ref, floor)
