"""A list of identical checkpointed blocks runs as one loop over their params stacked
(:mod:`parallax.step.list_scan`): the same values and gradients as the list, and under FSDP the
stack's cost, not the unrolled list's."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding

import parallax as px
from parallax.jaxpr.chains import REMAT
from parallax.step.list_scan import scanned_lists

pytestmark = pytest.mark.core

WIDTH, ROWS, LAYERS = 8, 16, 4


class Block(nn.Module):
    """Dropout and a normalisation: linen folds each block's path into its dropout key."""

    @nn.compact
    def __call__(self, h):
        return h + nn.Dropout(0.2, deterministic=False)(nn.Dense(WIDTH)(nn.LayerNorm()(h)))


class ListOf(nn.Module):
    """A Hugging Face–style list of ``nn.remat`` blocks (``blocks_0``, ``blocks_1``...)."""

    every_hidden_state: bool = False  # the model reads every block's output (output_hidden_states=True)

    @nn.compact
    def __call__(self, x):
        h, states = nn.Dense(WIDTH)(x), []
        for i in range(LAYERS):
            h = nn.remat(Block)(name=f"blocks_{i}")(h)
            states.append(h)
        out = nn.Dense(2)(h)
        return out + sum(s.mean() for s in states) if self.every_hidden_state else out


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def batches(steps=2):
    rng = np.random.default_rng(0)
    return [{"x": rng.normal(size=(ROWS, 3)).astype(np.float32), "y": rng.normal(size=(ROWS, 2)).astype(np.float32)}
            for _ in range(steps)]


def primitives(fn, *args):
    return [eqn.primitive.name for eqn in jax.make_jaxpr(fn)(*args).jaxpr.eqns]


def scan_lengths(jaxpr) -> list[int]:
    """The length of every ``scan`` in ``jaxpr``, nested ones included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            found.append(eqn.params["length"])
        for value in eqn.params.values():
            for inner in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    found += scan_lengths(inner)
    return found


def test_a_list_of_checkpointed_blocks_runs_as_one_loop_with_the_lists_values_gradients_and_dropout_masks():
    """Each block's dropout mask is drawn from a key folded with its own path: the loop steps over
    those constants, so every block draws what it draws in the list. A model that reads every
    block's output is left unrolled, as it is."""
    batch = batches(1)[0]
    for every in (False, True):
        model = ListOf(every_hidden_state=every)
        params = model.init(jax.random.key(0), batch["x"])["params"]

        def loss(params, batch, key, model=model):
            out = model.apply({"params": params}, batch["x"], rngs={"dropout": key})
            return jnp.mean((out - batch["y"]) ** 2)

        key = jax.random.key(1)
        looped = scanned_lists(loss)
        names = primitives(looped, params, batch, key)
        assert names.count("scan") == (0 if every else 1) and sum(n in REMAT for n in names) == (LAYERS if every else 0)
        np.testing.assert_allclose(jax.jit(looped)(params, batch, key), loss(params, batch, key), rtol=1e-6)
        got, want = jax.jit(jax.grad(looped))(params, batch, key), jax.grad(loss)(params, batch, key)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)
        if not every:  # dropout is on (another key moves the gradients): the equality above holds mask for mask
            other = jax.grad(loss)(params, batch, jax.random.key(2))
            assert any(not np.allclose(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(other)))


def test_fsdp_steps_a_list_of_checkpointed_blocks_at_the_stacks_cost_and_trains_like_one_device():
    """``benchmarks/llama.py``'s ``ListedLlama`` (a list of ``nn.remat`` blocks) under FSDP: the step
    loops over the blocks, so its peak is the same blocks stacked's plus each device's share of the
    blocks' params stacked (unrolled, the compiler gathered several blocks' params at once: here
    ~2× the stack's); ``scan_lists=False`` unrolls it, as data parallelism alone does (it would copy
    the params whole). And it trains as one device does, with AdamW."""
    from benchmarks.llama import ListedLlama, Llama, Shape, listed_params
    from benchmarks.llama import loss_fn as lm_loss

    shape = Shape(layers=4, dim=32, ffn=64, heads=4, kv_heads=2, vocab=64, dtype="float32")
    rng = np.random.default_rng(0)
    tokens = [{"tokens": rng.integers(0, shape.vocab, size=(8, 17)).astype(np.int32)} for _ in range(2)]
    stacked = Llama(shape).init(jax.random.key(0), tokens[0]["tokens"][:, :-1])["params"]
    listed = listed_params(stacked, shape.layers)
    strategy = px.FSDP(min_weight_size=0, split="largest")
    peaks, loops = {}, {}
    placed = jax.device_put(tokens[0], NamedSharding(strategy.make_mesh(), strategy.batch_spec()))
    for written, model, params, scan in (("stacked", Llama(shape), stacked, True),
                                         ("listed", ListedLlama(shape), listed, True),
                                         ("unrolled", ListedLlama(shape), listed, False)):
        state = px.init_state(model, optax.adamw(1e-2), tokens[0], strategy=strategy, loss_fn=lm_loss, params=params)
        traced = px.make_train_step(lm_loss, strategy, compile="jit", scan_lists=scan).trace(state, placed)
        peaks[written] = px.inspect.peak_bytes(px.inspect.memory_bytes(traced.lower().compile()))
        loops[written] = scan_lengths(traced.jaxpr.jaxpr).count(shape.layers)
    assert loops["listed"] == loops["stacked"] > loops["unrolled"] == 0, loops  # the blocks' loop, as the stack's
    dp = px.DataParallel()  # params whole on every device: the loop would copy them whole, so the list stays unrolled
    state = px.init_state(ListedLlama(shape), optax.adamw(1e-2), tokens[0], strategy=dp, loss_fn=lm_loss, params=listed)
    traced = px.make_train_step(lm_loss, dp, compile="jit").trace(
        state, jax.device_put(tokens[0], NamedSharding(dp.make_mesh(), dp.batch_spec())))
    assert scan_lengths(traced.jaxpr.jaxpr).count(shape.layers) == 0
    restacked = sum(x.nbytes for x in jax.tree.leaves(stacked["layers"])) / jax.device_count()
    assert peaks["listed"] - peaks["stacked"] <= 1.2 * restacked < peaks["unrolled"] - peaks["stacked"], (
        peaks, restacked)
    for mode in ("jit", "shard_map"):
        report = px.testing.assert_equivalent(ListedLlama(shape), optax.adamw(1e-2), lm_loss, tokens, strategy,
                                              params=listed, compile=mode)
        assert report.mode == mode, report


def test_a_list_with_dropout_trains_like_one_device_under_data_parallelism_and_fsdp():
    """The blocks' dropout masks, drawn in the loop, are one device's (per shard on ``shard_map``)."""
    for strategy, mode in ((px.combine(px.DataParallel(2), px.FSDP(4, min_weight_size=0)), "jit"),
                           (px.FSDP(min_weight_size=0), "shard_map")):
        report = px.testing.assert_equivalent(ListOf(), optax.adamw(1e-2), loss_fn, batches(), strategy, compile=mode)
        assert report.mode == mode, report


def test_scan_lists_takes_a_bool():
    try:
        px.StepOptions(scan_lists="yes")
    except ValueError as err:
        assert "scan_lists='yes'" in str(err) and "False" in str(err)
    else:
        raise AssertionError("scan_lists='yes' was taken")


@pytest.mark.wide("a Hugging Face model traced unrolled and looped, then trained against one device (20 s)")
def test_a_hugging_face_list_checkpointed_by_remat_runs_as_a_loop_and_trains_like_one_device():
    """Hugging Face's Flax GPT-2 (its blocks in a list, dropout on) with ``remat=("FlaxGPT2Block",)``:
    the blocks run as a loop (the step has a loop over the 3 blocks the unrolled one lacks), exact
    against one device with AdamW (``shard_map``'s path: the dropout test above)."""
    from tests import third_party

    model, batches_ = third_party.gpt2(layers=3, dropout=0.1), third_party.batches("text", 2)

    def loss(model, batch):  # GPT-2's causal-LM loss with its residual dropout on
        tokens = batch["tokens"]
        positions = np.broadcast_to(np.arange(tokens.shape[1] - 1), (tokens.shape[0], tokens.shape[1] - 1))
        logits = model(tokens[:, :-1], (tokens[:, :-1] >= 0).astype("int32"), positions, deterministic=False).logits
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    strategy, remat = px.FSDP(min_weight_size=0), ("FlaxGPT2Block",)
    state = px.init_state(model, optax.adamw(1e-2), batches_[0], strategy=strategy, loss_fn=loss)
    loops = {scan: scan_lengths(px.make_train_step(loss, strategy, compile="jit", remat=remat, scan_lists=scan).trace(
        state, batches_[0]).jaxpr.jaxpr).count(3) for scan in (True, False)}
    assert loops[True] > loops[False] == 0, loops
    report = px.testing.assert_equivalent(model, optax.adamw(1e-2), loss, batches_, strategy, compile="jit",
                                          remat=remat)
    assert report.mode == "jit", report
