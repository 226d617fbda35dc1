"""Bigger than the devices: host offload of the optimizer state and params, remat policies, and
a plan that says what would fit. Each option trains like a plain one-device optax loop."""

from __future__ import annotations

import functools
import json
import shutil

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from flax import nnx

import parallax as px
from parallax import inspect
from parallax.models.remat_policy import named_policy
from parallax.state.search import resolve
from parallax.step.offload import state_memory_kinds
from tests import tiers
from tests.models import MLP, Block, TinyLM, batches, classifier_loss, lm_loss
from tests.reference import OPTIMIZERS, TOL, one_device_state

pytestmark = pytest.mark.core

FSDP = px.FSDP(min_weight_size=0, split="largest")


class TwoBlockLM(nn.Module):
    """Two transformer blocks of one class: what remat names, and what a plan finds repeated."""

    @nn.compact
    def __call__(self, tokens, train: bool = True):
        x = nn.Embed(64, 32, name="embed")(tokens)
        for index in range(2):
            x = Block(name=f"block_{index}")(x, train)
        return nn.Dense(64, name="head")(nn.LayerNorm()(x))


class NNXBlock(nnx.Module):
    def __init__(self, dim: int, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(4, dim, use_bias=False, decode=False, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attn(self.norm(x), mask=mask)
        return x + self.down(nnx.gelu(self.up(x)))


class NNXLM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, vocab: int = 64, dim: int = 32):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.blocks = nnx.List([NNXBlock(dim, rngs) for _ in range(2)])
        self.head = nnx.Linear(dim, vocab, rngs=rngs)

    def __call__(self, tokens):
        x, mask = self.embed(tokens), nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)


def nnx_loss(model, batch):
    logits = model(batch["x"][:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["x"][:, 1:]).mean()


MODELS = {"linen": (TwoBlockLM, lm_loss, "Block"), "nnx": (lambda: NNXLM(nnx.Rngs(0)), nnx_loss, "NNXBlock")}
# Each offload level and each activation policy, each with SGD and AdamW.
GRID = [("optimizer", "dots", "sgd"), ("optimizer", "offload_dots", "adamw"),
        ("optimizer+params", "dots", "adamw"), ("optimizer+params", "offload_dots", "sgd"),
        (None, "dots_no_batch", "adamw"), (None, "nothing", "sgd")]


@functools.cache
def initial_params(name: str):
    """The model's initial params, built once on one device: each case starts both runs from them
    (``params=``) rather than compiling the same sharded random init twelve times; that the sharded
    init equals one device's is checked in tests/test_equivalence.py and tests/test_nnx.py."""
    build, loss, _ = MODELS[name]
    return jax.device_get(one_device_state(build(), optax.sgd(0.1), batches("lm", 1)[0], loss).params)


CASES = [(*g, name) for g in GRID for name in sorted(MODELS)]
# The core tier: optimizer state offloaded with host-offloaded remat on linen, and params too on NNX (AdamW).
CORE = [("optimizer", "offload_dots", "adamw", "linen"), ("optimizer+params", "dots", "adamw", "nnx")]


@pytest.mark.parametrize("offload,policy,opt_name,name",
                         tiers.cases(CASES, CORE))
def test_offload_and_remat_policies_train_like_one_device(name, offload, policy, opt_name):
    build, loss, block = MODELS[name]
    model = build() if name == "linen" else build
    report = px.testing.assert_equivalent(model, OPTIMIZERS[opt_name](), loss, batches("lm", 3), FSDP,
                                          params=initial_params(name), offload=offload,
                                          remat=(block, named_policy(policy)))
    print(report)  # held to 1e-5, or where plain jit on the mesh already drifts more, twice that floor


@pytest.fixture(scope="module")
def lm_steps():
    """TinyLM under FSDP with AdamW: states built with each offload level and their compiled steps."""
    data = batches("lm", 2)
    built = {}
    for offload in (None, "optimizer", "optimizer+params"):
        options = px.StepOptions(offload=offload, compile="jit")
        state = px.init_state(TinyLM(), optax.adamw(1e-2), data[0], strategy=FSDP, loss_fn=lm_loss, options=options)
        step = px.make_train_step(lm_loss, FSDP, options)
        built[offload] = (state, step, inspect.memory_bytes(step.lower(state, data[0]).compile()))
    return data, built


def test_offloaded_state_stays_in_host_memory_and_the_device_peak_drops_by_it(lm_steps):
    data, built = lm_steps
    summary = px.summarize(built[None][0])
    opt_bytes, param_bytes = summary.totals["opt_state"]["per_device"], summary.totals["params"]["per_device"]
    peaks = {offload: inspect.peak_bytes(memory) for offload, (_, _, memory) in built.items()}
    assert peaks[None] - peaks["optimizer"] >= opt_bytes, (peaks, opt_bytes)
    assert peaks[None] - peaks["optimizer+params"] >= opt_bytes + param_bytes, (peaks, opt_bytes, param_bytes)
    assert built["optimizer"][2]["host"] == opt_bytes and built[None][2]["host"] == 0
    # The optimizer state is fetched behind a barrier with the gradients: XLA:GPU otherwise fetched it
    # at the step's start, on the device at the backward pass's peak (benchmarks/results/gpu.md).
    barriers = {offload: step.lower(state, data[0]).as_text().count("optimization_barrier")
                for offload, (state, step, _) in built.items()}
    assert barriers[None] == 0 and barriers["optimizer"] == barriers["optimizer+params"] == 1, barriers
    losses, finals = {}, {}
    for offload, (state, step, _) in built.items():
        for batch in data:
            state, metrics = step(state, batch)
        kinds = state_memory_kinds(state)  # between steps
        assert kinds["opt_state"] == ({"device"} if offload is None else {"pinned_host"}), (offload, kinds)
        assert kinds["params"] == ({"pinned_host"} if offload == "optimizer+params" else {"device"}), (offload, kinds)
        summary = px.summarize(state)
        assert summary.totals["total"]["host"] == (0 if offload is None else summary.totals["opt_state"]["per_device"]
                                                   + (param_bytes if offload == "optimizer+params" else 0))
        losses[offload], finals[offload] = float(metrics["loss"]), state
    assert len(set(losses.values())) == 1, losses  # the same update, wherever the state lives
    # A step with offload=None keeps a state where it was built; one with a level moves a state built without.
    moved = px.make_train_step(lm_loss, FSDP, offload="optimizer+params", compile="jit")(finals["optimizer"],
                                                                                         data[0])[0]
    assert state_memory_kinds(moved)["params"] == {"pinned_host"}


@pytest.mark.wide("a checkpoint across offload and meshes; the Trainer's checkpoints are in the core tier")
def test_a_checkpoint_saved_with_offload_restores_without_it_and_on_another_mesh(tmp_path):
    x = np.random.default_rng(0).normal(size=(96, 24)).astype(np.float32)
    data = {"x": x, "y": (x[:, 0] > 0).astype(np.int32)}

    def trainer(strategy, devices=None, **options):
        return px.Trainer(MLP(), optax.adamw(1e-2), classifier_loss, strategy=strategy, devices=devices, batch_size=16,
                          progress=False, shuffle=False, compile="jit", **options)

    uninterrupted = trainer(FSDP, max_steps=6)
    whole = uninterrupted.fit(data)
    final = jax.tree.leaves(jax.device_get(uninterrupted.state.params))
    saved, copy = str(tmp_path / "offloaded"), str(tmp_path / "copy")
    first = trainer(FSDP, max_steps=3, checkpoint_dir=saved, offload="optimizer+params")
    first.fit(data)
    assert state_memory_kinds(first.state)["opt_state"] == {"pinned_host"}
    shutil.copytree(saved, copy)
    expected = [row["loss"] for row in whole.history.train][3:]
    for directory, strategy, devices, offload in ((saved, px.FSDP(4, min_weight_size=0, split="largest"),
                                                    jax.devices()[:4], None),
                                                   (copy, px.DataParallel(), None, "optimizer")):
        resumed = trainer(strategy, devices=devices, max_steps=6, checkpoint_dir=directory, offload=offload)
        result = resumed.fit(data, resume=True)
        np.testing.assert_allclose([row["loss"] for row in result.history.train], expected, atol=TOL)
        diff = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(jax.device_get(resumed.state.params)),
                                                                 final, strict=True))
        assert diff <= TOL, (offload, diff)
        assert state_memory_kinds(resumed.state)["opt_state"] == ({"pinned_host"} if offload else {"device"})


@pytest.mark.wide("the plan's search over offload options (12 s cold)")
def test_the_plan_names_the_option_that_fits_and_it_does(lm_steps):
    data, built = lm_steps
    peaks = {offload: inspect.peak_bytes(memory) for offload, (_, _, memory) in built.items()}
    budget = (peaks[None] + peaks["optimizer"]) // 2  # fits with the optimizer state offloaded, not without
    report = px.plan(TinyLM(), optax.adamw(1e-2), data[0], loss_fn=lm_loss, strategies=[FSDP], devices=8,
                     memory_budget=budget, compile="jit")
    assert not report.fits(report.rows[0]), report
    fix = report.fixes[str(budget)][-1]
    assert fix.fits and fix.change == "offload='optimizer'", report
    assert f"Nothing fits {budget}; for FSDP(fsdp=8): use offload='optimizer'" in str(report)
    plan = px.plan_state(TinyLM(), optax.adamw(1e-2), data[0], strategy=FSDP, loss_fn=lm_loss, offload="optimizer")
    compiled = px.make_train_step(lm_loss, FSDP, offload="optimizer", compile="jit").lower(
        plan.abstract_arrays(), data[0]).compile()
    assert inspect.peak_bytes(inspect.memory_bytes(compiled)) <= budget  # by the compiled step's own analysis
    # strategy="auto" offloads only when nothing fits without it.
    options = px.StepOptions(memory_budget=budget, compile="jit", timed_candidates=0)
    among = [FSDP, px.DataParallel()]
    found = resolve(TinyLM(), optax.adamw(1e-2), data[0], "auto", loss_fn=lm_loss, options=options, among=among)
    assert found.changes == {"offload": "optimizer"}, found.describe()
    assert "with offload='optimizer' to fit the memory budget" in found.describe()
    from parallax.step.options import memory_fallbacks

    # the order auto tries, cheapest first
    assert [fields for _, fields in memory_fallbacks(px.StepOptions(), lambda: ("Block",))] == [
        {"offload": "optimizer"}, {"remat": ("Block",)}, {"offload": "optimizer+params"},
        {"offload": "optimizer+params", "remat": ("Block",)}]
    assert [fields for _, fields in memory_fallbacks(px.StepOptions(remat=("Block",)), lambda: ("Block",))] == [
        {"offload": "optimizer"}, {"offload": "optimizer+params"}]
    roomy = resolve(TinyLM(), optax.adamw(1e-2), data[0], "auto", loss_fn=lm_loss, among=among,
                    options=px.StepOptions(memory_budget=peaks[None] * 4, compile="jit", timed_candidates=0))
    assert roomy.changes == {}


LM_BATCH = batches("lm", 1)[0]
TWO_BLOCK_LM = TwoBlockLM()


def test_the_repeated_blocks_remat_may_name_are_read_from_shapes_alone():
    """px.plan with a batch of ``jax.ShapeDtypeStruct`` s (as the guide plans a model it does not
    allocate) still finds the blocks to rematerialise, so remat is among the options it tries."""
    from parallax.models.blocks import repeated_blocks

    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), LM_BATCH)
    assert repeated_blocks(TWO_BLOCK_LM, shapes, lm_loss) == repeated_blocks(TWO_BLOCK_LM, LM_BATCH, lm_loss) != ()


@pytest.mark.wide("the CLI in a process of its own")
def test_the_cli_takes_offload_and_remat_options(capsys):
    from parallax.plan.__main__ import main

    args = ["tests.test_offload:TWO_BLOCK_LM", "--batch", "tests.test_offload:LM_BATCH",
            "--loss", "tests.models:lm_loss", "--devices", "8", "--strategies", "fsdp", "--min-weight-size", "0",
            "--compile", "jit"]  # one path: like with like
    assert main([*args, "--json"]) == 0
    (plain,) = json.loads(capsys.readouterr().out)["rows"]
    assert main([*args, "--offload", "optimizer", "--remat", "Block", "--remat-policy", "dots", "--json"]) == 0
    (offloaded,) = json.loads(capsys.readouterr().out)["rows"]
    assert offloaded["compiled"]["host"] == offloaded["state"]["opt_state"] == plain["state"]["opt_state"] > 0
    assert offloaded["state"]["host"] == offloaded["state"]["opt_state"] and plain["compiled"]["host"] == 0
    assert offloaded["peak"] < plain["peak"], (offloaded["peak"], plain["peak"])
    assert main([*args, "--remat-policy", "dots"]) == 2
    assert "--remat-policy applies to the module classes named by --remat" in capsys.readouterr().err


def test_the_plan_finds_the_repeated_blocks_to_remat():
    from parallax.models.blocks import repeated_blocks

    batch = batches("lm", 1)[0]
    assert repeated_blocks(TwoBlockLM(), batch, lm_loss) == ("Block",)
    assert repeated_blocks(TinyLM(), batch, lm_loss) == ()  # one block: nothing repeated
    assert repeated_blocks(lambda: NNXLM(nnx.Rngs(0)), batch, nnx_loss) == ("NNXBlock",)


def test_bad_offload_and_remat_options_are_clear_errors():
    with pytest.raises(ValueError, match=r"offload='cpu'; use None \(all state on the devices\) or one of "
                                         r"\('optimizer', 'optimizer\+params'\)"):
        px.StepOptions(offload="cpu")
    policy = jax.checkpoint_policies.dots_saveable
    with pytest.raises(ValueError, match=r"remat has the checkpoint policy .* but no module class to apply it to; "
                                         r"name the model's repeated block beside it, e.g. remat=\('Block', policy\)"):
        px.StepOptions(remat=policy)
    with pytest.raises(ValueError, match="at most one checkpoint policy"):
        px.StepOptions(remat=("Block", policy, jax.checkpoint_policies.nothing_saveable))
    with pytest.raises(ValueError, match=r"remat policy 'dot'; use one of \['dots', 'dots_no_batch'"):
        named_policy("dot")
    assert px.StepOptions(remat=("Block", policy)).remat == ("Block", policy)
