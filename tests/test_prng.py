"""Every PRNG JAX ships: threefry (JAX's default), ``rbg`` and ``unsafe_rbg`` (MaxText's default) as
``jax_default_prng_impl``, a seed, a raw key or a typed key (``jax.random.key``), and typed keys a model keeps
in its own state (MaxText's scanned layers do).

Each run with dropout is compared with a plain one-device loop under the same implementation, whose step ``t``
draws from ``fold_in(fold_in(state key, t), 0)`` (the train state's documented key); a checkpoint written under
each implementation resumes exactly. Before, a raw key's shape was fixed at threefry's ``uint32[2]``: "JAX
encountered invalid PRNG key data: expected key_data.shape to end with (4,); got shape=(2,)" under ``rbg``,
and a ``key<fry>`` leaf in a model's state made every candidate of a search fail ("Cannot interpret
'key<fry>' as a data type").
"""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import parallax as px
from parallax.step.train_state import as_key
from tests import tiers
from tests.reference import TOL, max_diff
from tests.third_party import VOCAB

pytestmark = pytest.mark.core

IMPLS = ["threefry2x32", "rbg", "unsafe_rbg"]
ROWS, SEQ, STEPS = 16, 8, 3


@pytest.fixture
def prng_impl(request):
    """``jax_default_prng_impl`` set for the test (``request.param``), JAX's own restored after it."""
    before = jax.config.jax_default_prng_impl
    jax.config.update("jax_default_prng_impl", request.param)
    try:
        yield request.param
    finally:
        jax.config.update("jax_default_prng_impl", before)


class DropoutLM(nn.Module):
    keep_key: bool = False  # a typed key kept in the model's own state (a variable collection), as MaxText keeps some

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, 32)(tokens)
        if self.keep_key:
            kept = self.variable("keys", "noise", lambda: jax.random.key(7))
            x = x + 0.01 * jax.random.normal(kept.value, x.shape[-1:])
        x = nn.Dropout(0.1, deterministic=False)(nn.relu(nn.Dense(32)(x)))
        return nn.Dense(VOCAB)(x)


def lm_loss(model, batch):
    tokens = batch["tokens"]
    return optax.softmax_cross_entropy_with_integer_labels(model(tokens[:, :-1]), tokens[:, 1:]).mean()


def batches(steps=STEPS):
    rng = np.random.default_rng(0)
    return [{"tokens": rng.integers(0, VOCAB, (ROWS, SEQ + 1)).astype(np.int32)} for _ in range(steps)]


def init_params(model):
    return jax.device_get(model.init({"params": jax.random.key(1), "dropout": jax.random.key(2)},
                                     batches(1)[0]["tokens"][:, :-1]))


def one_device(model, tx, variables, state_key, data):
    """value_and_grad + optax on one device, step t's dropout from fold_in(fold_in(state_key, t), 0)."""
    others = {name: value for name, value in variables.items() if name != "params"}

    @jax.jit
    def step(params, opt_state, batch, key):
        def loss(p):
            return model.apply({"params": p, **others}, batch, rngs={"dropout": key}, method=lambda m, b: lm_loss(m, b))

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    params, losses = variables["params"], []
    opt_state = tx.init(params)
    for t, batch in enumerate(data):
        params, opt_state, value = step(params, opt_state, batch,
                                        jax.random.fold_in(jax.random.fold_in(state_key, t), 0))
        losses.append(float(value))
    return np.array(losses), jax.device_get(params)


def state_key_of(rng):
    return jax.device_get(jax.random.split(as_key(rng), 3)[2])


KEYS = {"seed": lambda: 0, "raw": lambda: jax.random.PRNGKey(0), "typed": lambda: jax.random.key(0),
        "typed-threefry": lambda: jax.random.key(0, impl="threefry2x32")}  # another impl than the default, for rbg
INIT_GRID = [(impl, key) for impl in IMPLS for key in ("seed", "raw", "typed")] + [("unsafe_rbg", "typed-threefry")]


@pytest.mark.parametrize("prng_impl, key", tiers.cases(INIT_GRID, [("unsafe_rbg", "typed"), ("rbg", "raw")],
                                                      "the other implementations and key forms: the core tier runs "
                                                      "MaxText's unsafe_rbg with a typed key, rbg with a raw one"),
                         indirect=["prng_impl"])
def test_init_state_trains_with_dropout_like_one_device_under_every_prng(prng_impl, key):
    model, tx, data = DropoutLM(), optax.adamw(3e-3, weight_decay=0.1), batches()
    variables, rng = init_params(model), KEYS[key]()
    strategy = px.combine(px.FSDP(4, min_weight_size=0), px.TensorParallel(2))
    state = px.init_state(model, tx, data[0], strategy=strategy, loss_fn=lm_loss, rng=rng, params=variables["params"])
    assert state.rng.shape == jax.eval_shape(lambda: jax.random.PRNGKey(0)).shape  # the default impl's raw key
    step, losses = px.make_train_step(lm_loss, strategy), []
    for batch in data:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    ref_losses, ref_params = one_device(model, tx, variables, state_key_of(rng), data)
    assert np.abs(np.array(losses) - ref_losses).max() <= TOL, (losses, ref_losses)
    assert max_diff(jax.device_get(state.params), ref_params) <= TOL


@pytest.mark.parametrize("prng_impl", tiers.cases(IMPLS, ["unsafe_rbg"], "threefry and rbg: the core tier runs "
                                                  "unsafe_rbg, whose keys have rbg's shape"), indirect=True)
def test_the_trainer_with_dropout_checkpoints_and_resumes_exactly_under_every_prng(prng_impl, tmp_path):
    """The default FSDP (its split search on), a run of 2 steps checkpointed then resumed for the third: the
    losses and final params of one uninterrupted one-device run; the model's own typed key kept in its state."""
    model, tx, data = DropoutLM(keep_key=True), optax.sgd(0.1), batches()
    variables = init_params(model)
    whole = {"tokens": np.concatenate([b["tokens"] for b in data])}

    def trainer(steps):
        return px.Trainer(model, tx, lm_loss, strategy=px.FSDP(min_weight_size=0), batch_size=ROWS, max_steps=steps,
                          shuffle=False, progress=False, summary=False, checkpoint_dir=str(tmp_path),
                          params=variables["params"])

    _, first = trainer(2).fit(whole)
    state, second = trainer(3).fit(whole, resume=True)
    losses = [row["loss"] for row in first.train + second.train]
    assert jax.dtypes.issubdtype(state.model_state["keys"]["noise"].dtype, jax.dtypes.prng_key)  # kept typed
    ref_losses, ref_params = one_device(model, tx, variables, state_key_of(0), data)
    assert np.abs(np.array(losses) - ref_losses).max() <= TOL, (losses, ref_losses)
    assert max_diff(jax.device_get(state.params), ref_params) <= TOL


def test_typed_keys_in_a_models_state_are_planned_summarized_and_searched():
    """A ``key<fry>`` leaf in a model's own state: ``px.summarize`` counts its bytes, ``px.plan`` prices FSDP and
    TP, and ``"auto"`` finds its candidates (each failed with "Cannot interpret 'key<fry>' as a data type")."""
    model, tx, batch = DropoutLM(keep_key=True), optax.adamw(1e-3), batches(1)[0]
    summary = px.summarize(px.plan_state(model, tx, batch, strategy=px.FSDP(min_weight_size=0), loss_fn=lm_loss))
    assert summary.totals["model_state"]["global"] == 8  # one threefry key: two uint32
    rows = px.plan(model, tx, batch, loss_fn=lm_loss, strategies=[px.FSDP(min_weight_size=0), px.TensorParallel()],
                   compile="jit").rows
    assert [row["error"] for row in rows] == [None, None], rows
    found = px.init_state(model, tx, batch, strategy="auto", loss_fn=lm_loss,
                          options=px.StepOptions(timed_candidates=0))
    assert jax.dtypes.issubdtype(found.model_state["keys"]["noise"].dtype, jax.dtypes.prng_key)


def test_a_key_of_another_shape_is_refused_naming_the_impl_and_the_fix():
    """Checked where the key is read (nothing compiles): a threefry raw key under rbg cannot be read as rbg's."""
    before = jax.config.jax_default_prng_impl
    try:
        jax.config.update("jax_default_prng_impl", "rbg")
        with pytest.raises(ValueError, match=r"rng=.* is not a raw PRNG key of JAX's default implementation \(rbg: "
                                             r"uint32\[4\]\); got uint32\[2\]\. Pass a seed \(rng=0\), a typed key"):
            as_key(np.array([0, 1], np.uint32))
        assert as_key(jax.random.key(0, impl="threefry2x32")).shape == (4,)  # drawn from it, in the default impl
    finally:
        jax.config.update("jax_default_prng_impl", before)
    with pytest.raises(TypeError, match="rng must be a seed"):
        as_key("zero")
