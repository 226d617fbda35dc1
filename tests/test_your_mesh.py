"""Your mesh, your model's own sharding calls, your pretrained weights (the JAX and Flax of today).

Every run is compared with a plain one-device optax loop (``tests.reference.run_plain``) from
the same initial values. A model whose own sharding names mesh axes runs its one-device
reference under a one-device mesh with the same axis names (what its author would do).
"""

from __future__ import annotations

import contextlib
import pathlib
import sys

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import parallax as px
from tests import tiers
from tests.reference import TOL, max_diff, run_plain, run_steps

pytestmark = pytest.mark.core

E, A = AxisType.Explicit, AxisType.Auto
MESH_TYPES = {"explicit": (E, E), "auto": (A, A), "mixed": (E, A)}
STRATEGIES = {
    "fsdp": lambda: px.combine(px.FSDP(min_weight_size=0, split="largest"), px.TensorParallel(1)),
    "tp": lambda: px.combine(px.FSDP(1, min_weight_size=0, split="largest"), px.TensorParallel()),
    "fsdp+tp": lambda: px.combine(px.FSDP(4, min_weight_size=0, split="largest"), px.TensorParallel(2)),
}
SHAPES = {"fsdp": (8, 1), "tp": (1, 8), "fsdp+tp": (4, 2)}


class Net(nn.Module):
    """An embedding and two dense layers; ``call`` picks the model's own sharding call on the hidden layer."""

    call: str = "none"
    spec: tuple = ()

    @nn.compact
    def __call__(self, tokens):
        if self.call == "reshard":  # Explicit-mode code: no gather by index (an embedding lookup needs out_sharding)
            # inputs of order 1: a loss of order 1 (raw tokens gave ~300, whose ulp is 3e-5)
            x = tokens.astype(jnp.float32) / 32
        else:
            x = nn.Embed(32, 16)(tokens).mean(1)
        x = nn.Dense(64)(x)
        if self.call == "wsc":
            x = jax.lax.with_sharding_constraint(x, P(*self.spec))
        elif self.call == "wsc_named":
            x = jax.lax.with_sharding_constraint(x, NamedSharding(jax.sharding.get_abstract_mesh(), P(*self.spec)))
        elif self.call == "reshard":
            x = jax.sharding.reshard(x, P(*self.spec))
        return nn.Dense(8)(nn.relu(x))


def loss_fn(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def onehot_loss(model, batch):
    """Cross-entropy as Explicit-mode code writes it (no gather by index)."""
    logits = model(batch["x"])
    return -(jax.nn.one_hot(batch["y"], 8) * jax.nn.log_softmax(logits)).sum(-1).mean()


def _batches(n=3):
    rs = np.random.RandomState(0)
    return [{"x": rs.randint(0, 32, (16, 4)).astype(np.int32), "y": rs.randint(0, 8, (16,)).astype(np.int32)}
            for _ in range(n)]


BATCHES = _batches()


def one_device_mesh(names, explicit=False):
    kind = E if explicit else A
    return jax.make_mesh((1,) * len(names), tuple(names), devices=jax.devices()[:1], axis_types=(kind,) * len(names))


def check_against_one_device(model, tx, lf, state, step, names=("fsdp", "tensor"), explicit=False, batches=BATCHES):
    """Trains ``state`` with ``step`` and the plain loop on one device; both trajectories and final params agree."""
    with jax.set_mesh(one_device_mesh(names, explicit)):
        ref = run_plain(model, tx, lf, state, batches)
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    loss_diff = float(np.abs(np.array(losses) - ref.losses).max())
    param_diff = max_diff(jax.device_get(state.params), ref.params)
    assert loss_diff <= TOL and param_diff <= TOL, (loss_diff, param_diff)
    return state


MESH_GRID = [(kind, types) for kind in STRATEGIES for types in MESH_TYPES]


@pytest.mark.parametrize("kind, types", tiers.cases(  # the core tier: each kind once, each axis type once
    MESH_GRID, [("fsdp", "explicit"), ("tp", "auto"), ("fsdp+tp", "mixed")]))
def test_init_state_takes_your_mesh_of_any_axis_types_inside_your_set_mesh(kind, types):
    mesh = jax.make_mesh(SHAPES[kind], ("fsdp", "tensor"), devices=jax.devices()[::-1], axis_types=MESH_TYPES[types])
    strategy, tx = STRATEGIES[kind](), (optax.sgd(0.1) if kind == "tp" else optax.adam(1e-2))
    with jax.set_mesh(mesh):  # as a user's script sets it, and no mesh=: the mesh in context is the one used
        state = px.init_state(Net(), tx, BATCHES[0], strategy=strategy, loss_fn=loss_fn)
        placed = state.params["Dense_0"]["kernel"].sharding.mesh
        assert list(placed.devices.flat) == list(mesh.devices.flat)  # the user's devices in the user's order
        assert placed.axis_types == (A, A)  # an ordinary model runs with Auto axes
        check_against_one_device(Net(), tx, loss_fn, state, px.make_train_step(loss_fn, strategy))


@pytest.mark.parametrize("types", tiers.cases(list(MESH_TYPES), ["explicit"]))
def test_trainer_takes_your_mesh_and_fits_inside_your_set_mesh(capsys, types):
    devices = np.array(jax.devices())[::-1]  # an unusual device order, kept
    mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"), devices=list(devices), axis_types=MESH_TYPES[types])
    strategy = px.combine(px.FSDP(min_weight_size=0, split="largest"), px.TensorParallel())
    data = {"x": np.concatenate([b["x"] for b in BATCHES]), "y": np.concatenate([b["y"] for b in BATCHES])}
    tx = optax.adamw(1e-2, weight_decay=0.1)
    first = px.init_state(Net(), tx, BATCHES[0], strategy=strategy, loss_fn=loss_fn, mesh=mesh)
    with jax.set_mesh(one_device_mesh(("fsdp", "tensor"))):
        ref = run_plain(Net(), tx, loss_fn, first, BATCHES)
    for given, context in ((mesh, contextlib.nullcontext()), (None, jax.set_mesh(mesh))):  # mesh=, or set the JAX way
        trainer = px.Trainer(Net(), tx, loss_fn, strategy=strategy, mesh=given, batch_size=16, max_steps=3,
                             shuffle=False, progress=True, summary=False)
        with context:
            state, history = trainer.fit(data)
        assert list(trainer.mesh.devices.flat) == list(devices)
        assert trainer.strategy.describe() == "FSDP(fsdp=4) × TensorParallel(tensor=2)"  # sizes resolved
        losses = np.array([row["loss"] for row in history.train])
        assert np.abs(losses - ref.losses).max() <= TOL
        assert max_diff(jax.device_get(state.params), ref.params) <= TOL
    # px.plan plans on the mesh in context: its devices (4 of the 8 here), and the mesh itself for a strategy it fits
    four = jax.make_mesh((2, 2), ("fsdp", "tensor"), devices=list(devices[:4]), axis_types=MESH_TYPES[types])
    with jax.set_mesh(four):
        (row,) = px.plan(Net(), tx, BATCHES[0], loss_fn=loss_fn, strategies=[strategy]).rows
    assert row["error"] is None and row["devices"] == 4 and row["mesh"] == {"fsdp": 2, "tensor": 2}, row
    said = capsys.readouterr().out
    if types != "auto":  # axis types changed: said with progress
        assert f"Sharding mode: Auto axes, an ordinary model (the mesh's own axes were fsdp=4 " \
               f"{'Explicit' if MESH_TYPES[types][0] == E else 'Auto'}" in said, said


@pytest.mark.parametrize("kind", tiers.cases(["tp", "fsdp+tp"], ["fsdp+tp"]))
def test_assert_equivalent_inside_your_explicit_set_mesh(kind):
    """``assert_equivalent`` run inside the user's ``set_mesh`` of an Explicit mesh, on a model with an
    embedding lookup: the run trains on Auto axes, and the one-device reference it re-runs with the
    strategy's placement runs on that mesh, not the caller's (before, JAX refused it: "context mesh
    ... Explicit should match the aval mesh ... Auto")."""
    mesh = jax.make_mesh(SHAPES[kind], ("fsdp", "tensor"), axis_types=MESH_TYPES["explicit"])
    with jax.set_mesh(mesh):
        report = px.testing.assert_equivalent(Net(), optax.adamw(1e-2), loss_fn, BATCHES[:2], STRATEGIES[kind]())
    assert "TensorParallel(tensor=" in report.strategy, report


def test_the_cost_model_measures_on_its_own_mesh_inside_yours(tmp_path, monkeypatch):
    """A cold cost cache is measured on the cost model's own mesh even inside the caller's ``set_mesh``
    (before, JAX refused its shard_map there: seen in a two-process fit)."""
    from parallax.pricing.cost import calibrate

    # Its own cache: measuring again into the suite's shared one changed, mid-run, what another
    # worker's plan and step priced (a plan and its step disagreeing on a close call in CI).
    monkeypatch.setenv("PARALLAX_CACHE_DIR", str(tmp_path))
    with jax.set_mesh(jax.make_mesh((8,), ("fsdp",))):
        speeds = calibrate(refresh=True)
    assert speeds.seconds_per_flop >= 0 and set(speeds.collectives) >= {"all-gather", "reduce-scatter"}


SELF_GRID = [(kind, call) for kind in ["dp", "fsdp", "tp", "dp+fsdp", "dp+fsdp+tp"]
             for call in ["wsc", "wsc_named", "reshard"]]


@pytest.mark.parametrize("kind, call", tiers.cases(  # the core tier: each kind once, each way of sharding once
    SELF_GRID, [("dp", "wsc"), ("fsdp", "reshard"), ("tp", "wsc_named"), ("dp+fsdp+tp", "wsc")]))
def test_models_that_shard_themselves_train_like_one_device(call, kind):
    strategy = {"dp": px.DataParallel(), "fsdp": px.FSDP(min_weight_size=0, split="largest"), "tp": px.TensorParallel(),
                "dp+fsdp": px.combine(px.DataParallel(2), px.FSDP(4, min_weight_size=0, split="largest")),
                "dp+fsdp+tp": px.combine(px.DataParallel(2), px.FSDP(2, min_weight_size=0, split="largest"),
                                         px.TensorParallel(2))}[kind]
    spec = ({"dp": ("data", None), "fsdp": ("fsdp", None), "tp": (None, "tensor"),
             "dp+fsdp": (("data", "fsdp"), None), "dp+fsdp+tp": (("data", "fsdp"), "tensor")})[kind]
    model, lf = Net(call, spec), (onehot_loss if call == "reshard" else loss_fn)
    tx = optax.sgd(0.1) if kind in ("dp", "tp") else optax.adam(1e-2)
    # a row-parallel Dense on Explicit axes needs out_sharding, which linen lacks
    if call == "reshard" and "tp" in kind:
        with pytest.warns(UserWarning, match=r"split over \['tensor'\] are gathered whole where the model uses them "
                                             r"\(JAX refuses them split: Contracting dimensions are sharded"):
            state = px.init_state(model, tx, BATCHES[0], strategy=strategy, loss_fn=lf)
        assert state.params["Dense_1"]["kernel"].sharding.spec[0] == "tensor"  # stored split all the same
    else:
        state = px.init_state(model, tx, BATCHES[0], strategy=strategy, loss_fn=lf)
    explicit = call == "reshard"
    assert state.params["Dense_0"]["kernel"].sharding.mesh.axis_types[0] == (E if explicit else A)
    step = px.make_train_step(lf, strategy)
    names = [name for name, _ in strategy.mesh_axes()]
    check_against_one_device(model, tx, lf, state, step, names=names, explicit=explicit)
    if explicit:  # jit: the only path for Explicit axes (or for no data axis, said first)
        assert step.mode() == "jit" and ("Explicit" in step.describe() or kind == "tp"), step.describe()


class ExplicitNnx(nnx.Module):
    """NNX code written for Explicit axes: built under its author's ``jax.set_mesh``, its first layer
    told the sharding of its output (``out_sharding``), no gather by index."""

    def __init__(self, rngs):
        self.up, self.down = nnx.Linear(4, 64, rngs=rngs), nnx.Linear(64, 8, rngs=rngs)

    def __call__(self, tokens):
        x = tokens.astype(jnp.float32) / 32
        return self.down(nnx.relu(self.up(x, out_sharding=P("fsdp", None))))


class TensorNnx(ExplicitNnx):
    """NNX code written for Explicit axes and tensor parallelism: each contraction over a split dim
    told its output's sharding."""

    def __call__(self, tokens):
        x = tokens.astype(jnp.float32) / 32
        return self.down(nnx.relu(self.up(x, out_sharding=P("fsdp", "tensor"))), out_sharding=P("fsdp", None))


EXPLICIT_GRID = [(model, kind) for model in ["linen reshard", "nnx out_sharding", "nnx tensor"]
                 for kind in ["fsdp", "fsdp+tp"] if not (model == "nnx tensor" and kind == "fsdp")]


@pytest.mark.parametrize("model, kind", tiers.cases(EXPLICIT_GRID, [("linen reshard", "fsdp"),
                                                                    ("nnx out_sharding", "fsdp+tp"),
                                                                    ("nnx tensor", "fsdp+tp")]))
def test_explicit_mode_models_train_inside_your_explicit_set_mesh(model, kind, recwarn):
    """A model written for Explicit axes, run as its author runs it: inside ``jax.set_mesh`` of an
    Explicit mesh (devices reversed) and given no ``mesh=``; the state on that mesh. Under FSDP × TP
    a model that says how its tensor-split contractions are sharded keeps its params split there;
    one that does not (its hidden layer pinned whole, as written for FSDP) gets them gathered where
    used, with a warning saying so (before, JAX refused it: "Contracting dimensions are sharded")."""
    names = ("fsdp",) if kind == "fsdp" else ("fsdp", "tensor")
    mesh = jax.make_mesh(SHAPES[kind][:len(names)], names, devices=jax.devices()[::-1], axis_types=(E,) * len(names))
    strategy = px.FSDP(min_weight_size=0, split="largest") if kind == "fsdp" else STRATEGIES[kind]()
    tx = optax.adam(1e-2)
    with jax.set_mesh(mesh):
        net = (Net("reshard", ("fsdp", None)) if model.startswith("linen") else
               ExplicitNnx(nnx.Rngs(0)) if model == "nnx out_sharding" else TensorNnx(nnx.Rngs(0)))
        state = px.init_state(net, tx, BATCHES[0], strategy=strategy, loss_fn=onehot_loss)
        placed = jax.tree.leaves(state.params)[0].sharding.mesh
        assert list(placed.devices.flat) == list(mesh.devices.flat) and set(placed.axis_types) == {E}, placed
        gathered = [str(w.message) for w in recwarn if "gathered whole where the model uses" in str(w.message)]
        assert len(gathered) == (model == "nnx out_sharding" and kind == "fsdp+tp"), gathered
        step = px.make_train_step(onehot_loss, strategy)
        if model.startswith("linen"):
            check_against_one_device(net, tx, onehot_loss, state, step, names=names, explicit=True)
        else:
            initial = jax.device_get(state.params)
            final, losses = run_steps(step, state, BATCHES)
            with jax.set_mesh(one_device_mesh(names, explicit=True)):  # where its author runs it on one device
                ref_params, ref_losses = plain_nnx(net, tx, onehot_loss, initial, BATCHES)
            assert (np.abs(losses - ref_losses).max() <= TOL
                    and max_diff(jax.device_get(final.params), ref_params) <= TOL)
    assert step.mode() == "jit" and "Explicit" in step.describe()
    if kind == "fsdp+tp":  # the tensor split stays in the state (and, for the model that says how, in the step)
        assert "tensor" in jax.tree.leaves(state.params)[0].sharding.spec or \
            any("tensor" in leaf.sharding.spec for leaf in jax.tree.leaves(state.params))


def plain_nnx(module, tx, lf, params, batches):
    """value_and_grad over an NNX module's params + optax, one jitted step: what its author writes."""
    graphdef, _, rest = nnx.split(module, nnx.Param, ...)

    @jax.jit
    def step(params, opt_state, batch):
        value, grads = jax.value_and_grad(lambda p: lf(nnx.merge(graphdef, p, rest), batch))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    opt_state, losses = tx.init(params), []
    for batch in batches:
        params, opt_state, value = step(params, opt_state, batch)
        losses.append(float(value))
    return jax.device_get(params), np.array(losses)


class Annotated(nn.Module):
    """A linen model annotated for a mesh with ``fsdp`` and ``tensor`` axes (``nn.with_partitioning``)."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(32, 16)(tokens).mean(1)
        init = nn.initializers.lecun_normal()
        x = nn.Dense(64, kernel_init=nn.with_partitioning(init, ("fsdp", "tensor")))(x)
        return nn.Dense(8, kernel_init=nn.with_partitioning(init, ("tensor", "fsdp")))(nn.relu(x))


def test_a_model_naming_an_axis_the_mesh_lacks_keeps_its_params_whole_along_it(caplog):
    """A model's own sharding (annotations, a constraint in its code) naming an axis no part splits
    trains as on one device, whole along that axis (a size-1 axis on the mesh), with a warning."""
    for strategy in (px.DataParallel(), px.FSDP(min_weight_size=0)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="parallax"):
            report = px.testing.assert_equivalent(Annotated(), optax.adam(1e-2), loss_fn, BATCHES[:2], strategy)
        assert report.passed and report.max_diff <= TOL, report
        text = caplog.text
        assert "names mesh axis 'tensor'" in text and "params stay whole along it" in text, text
        assert "TensorParallel(axis='tensor')" in text and "size 1" in text, text
    state = px.init_state(Net("wsc", ("fsdp", "tensor")), optax.sgd(0.1), BATCHES[0], strategy=px.FSDP(),
                          loss_fn=loss_fn)  # a constraint in its code: its mesh needs the axis in context
    assert dict(jax.tree.leaves(state.params)[0].sharding.mesh.shape) == {"fsdp": 8, "tensor": 1}
    assert np.isfinite(float(px.make_train_step(loss_fn, px.FSDP())(state, BATCHES[0])[1]["loss"]))
    with pytest.raises(ValueError, match="Mesh axis 'tensor' has 2 devices but no part of the strategy"):
        px.init_state(Net(), optax.sgd(0.1), BATCHES[0], strategy=px.FSDP(),
                      mesh=jax.make_mesh((4, 2), ("fsdp", "tensor")))
    with pytest.raises(ValueError, match="sharding_mode='explicitly'"):
        px.Trainer(Net(), optax.sgd(0.1), loss_fn, sharding_mode="explicitly")


def test_the_shard_map_path_refuses_models_that_shard_themselves_by_name():
    strategy, per_example = px.FSDP(min_weight_size=0, split="largest"), px.per_example_loss(loss_fn)
    state = px.init_state(Net("reshard", ("fsdp", None)), optax.sgd(0.1), BATCHES[0], strategy=strategy,
                          loss_fn=onehot_loss)
    with pytest.raises(ValueError, match=r"compile='shard_map' needs the shard_map path.*Explicit axes"):
        px.make_train_step(onehot_loss, strategy, compile="shard_map")(state, BATCHES[0])
    # with_sharding_constraint over a data axis: forced shard_map says so; auto leaves that path out.
    state = px.init_state(Net("wsc", ("fsdp", None)), optax.sgd(0.1), BATCHES[0], strategy=strategy, loss_fn=loss_fn)
    with pytest.raises(ValueError, match=r"constrains its own arrays with a sharding over the data axes "
                                         r"\(P\('fsdp', None\): jax.lax.with_sharding_constraint\).*compile='jit' or "
                                         r"'auto'"):
        px.make_train_step(loss_fn, strategy, compile="shard_map")(state, BATCHES[0])
    step = px.make_train_step(per_example, strategy)
    assert np.isfinite(float(step(state, BATCHES[0])[1]["loss"]))
    assert step.mode() == "jit" and set(step.choice.estimates) == {"jit"}


# --- Flax's NNX Gemma example, from the flax source distribution (`make setup` extracts it) -------------------

def _gemma():
    folder = pathlib.Path(sys.prefix) / "flax-examples" / flax.__version__ / "gemma"
    assert (folder / "transformer.py").exists(), f"{folder} is missing: run `make setup` (it extracts flax's examples)"
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    import modules
    import transformer
    import transformer_cfg

    return transformer, transformer_cfg, modules


def _gemma_model(sharded: bool):
    transformer, cfg, modules = _gemma()
    shd = (cfg.ShardingConfig.fsdp_tp_sharding(fsdp_axis_name="fsdp", tensor_parallel_axis_name="tensor")
           if sharded else cfg.ShardingConfig.no_sharding())
    config = cfg.TransformerConfig(num_layers=2, num_embed=64, embed_dim=32, hidden_dim=64, num_heads=4, head_dim=8,
                                   num_kv_heads=2, final_logit_softcap=None, use_post_attn_norm=True,
                                   use_post_ffw_norm=True, attention_types=(modules.AttentionType.GLOBAL,) * 2,
                                   shd_config=shd)
    return transformer.Transformer(config, rngs=nnx.Rngs(0)), transformer


def test_flax_gemma_example_with_its_own_sharding_config_trains_like_one_device():
    mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"))  # as the example's train.py: Explicit axes
    with jax.set_mesh(mesh):  # the example builds its model under its mesh
        model, transformer = _gemma_model(sharded=True)

    def gemma_loss(model, tokens):  # the example's weighted cross-entropy, as one-hot (Explicit-mode code)
        mask = tokens > 0
        logits, _ = model(tokens, transformer.build_positions_from_mask(mask), None,
                          transformer.make_causal_attn_mask(mask))
        onehot = jax.nn.one_hot(tokens[:, 1:], logits.shape[-1])
        return -(onehot * jax.nn.log_softmax(logits[:, :-1])).sum(-1).mean()

    tokens = [np.random.RandomState(i).randint(1, 64, (8, 12)).astype(np.int32) for i in range(3)]
    strategy = px.combine(px.FSDP(4, min_weight_size=0, split="largest"), px.TensorParallel(2))
    reference, _ = _gemma_model(sharded=False)  # the same values (same seed), no sharding
    ref_opt = nnx.Optimizer(reference, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def ref_step(model, opt, batch):
        loss, grads = nnx.value_and_grad(gemma_loss)(model, batch)
        opt.update(model, grads)
        return loss

    ref_losses = [float(ref_step(reference, ref_opt, t)) for t in tokens]
    trainer = px.Trainer(model, optax.adam(1e-2), gemma_loss, strategy=strategy, mesh=mesh, progress=False,
                         batch_size=8)
    plan_state = trainer.init(tokens[0])
    assert plan_state.params["embedder"]["embedding"].sharding.mesh.axis_types == (E, E)
    assert tuple(plan_state.params["embedder"]["embedding"].sharding.spec) == ("tensor", "fsdp")
    step = trainer.train_step
    losses = []
    for t in tokens:
        plan_state, metrics = step(plan_state, t)
        losses.append(float(metrics["loss"]))
    assert np.abs(np.array(losses) - np.array(ref_losses)).max() <= TOL, (losses, ref_losses)
    ref_params = nnx.to_pure_dict(nnx.state(reference, nnx.Param))
    assert max_diff(jax.device_get(plan_state.params), ref_params) <= TOL
    assert "Explicit axes" in trainer.plan.sharding_note


# --- pretrained weights ------------------------------------------------------------------------------------------

@pytest.mark.wide("Hugging Face params under FSDP x TP (13 s cold); Hugging Face models train against one device in"
                  " the core tier (tests/test_third_party.py)")
def test_hugging_face_params_start_training_under_fsdp_tp():
    from tests.third_party import SEQ, VOCAB, _transformers, causal_lm_loss

    t = _transformers()
    config = t.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=1, n_head=4, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0)
    hf = t.FlaxGPT2LMHeadModel(config, seed=7)  # stands in for from_pretrained (no downloads in tests)
    tokens = np.random.RandomState(1).randint(1, VOCAB, (8, SEQ + 1)).astype(np.int32)
    # one program, not op by op
    own = float(jax.jit(lambda params: hf.module.apply({"params": params}, {"tokens": tokens},
                                                      method=lambda m, b: causal_lm_loss(m, b)))(hf.params))
    strategy = px.combine(px.FSDP(4, min_weight_size=0, split="largest"), px.TensorParallel(2))
    trainer = px.Trainer(hf.module, optax.adam(1e-3), causal_lm_loss, strategy=strategy, params=hf.params,
                         batch_size=8, max_steps=2, shuffle=False, progress=False)
    _state, history = trainer.fit({"tokens": np.concatenate([tokens, tokens])})
    assert abs(history.train[0]["loss"] - own) <= TOL, (history.train[0]["loss"], own)
    wte = trainer.plan.build().params["transformer"]["wte"]["embedding"]
    assert {s.data.shape for s in wte.addressable_shards} != {wte.shape}  # placed shard by shard
    np.testing.assert_array_equal(jax.device_get(wte), hf.params["transformer"]["wte"]["embedding"])
    # The model object as it is: its module, and its params as the start; proven against one device from them.
    batches = [{"tokens": tokens}] * 2
    report = px.testing.assert_equivalent(hf, optax.adam(1e-3), causal_lm_loss, batches, strategy)
    assert report.passed and abs(report.losses[0] - own) <= TOL, (report.losses[0], own)
    assert report.strategy == "FSDP(fsdp=4) × TensorParallel(tensor=2)"
    trainer = px.Trainer(hf, optax.adam(1e-3), causal_lm_loss, strategy=strategy, batch_size=8, max_steps=1,
                         shuffle=False, progress=False)
    assert abs(trainer.fit({"tokens": tokens}).history.train[0]["loss"] - own) <= TOL


def test_pretrained_params_from_a_tree_or_an_orbax_path_with_named_mismatches(tmp_path):
    import orbax.checkpoint as ocp

    tx = optax.sgd(0.1)
    strategy = px.FSDP(min_weight_size=0, split="largest")
    init = jax.device_get(px.init_state(Net(), tx, BATCHES[0], strategy=strategy, loss_fn=loss_fn, rng=5).params)
    for given in ({"params": init}, init):
        state = px.init_state(Net(), tx, BATCHES[0], strategy=strategy, loss_fn=loss_fn, params=given)
        assert max_diff(jax.device_get(state.params), init) == 0.0
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", {"params": init, "step": 3})
    checkpointer.wait_until_finished()
    state = px.init_state(Net(), tx, BATCHES[0], strategy=strategy, loss_fn=loss_fn, params=tmp_path / "ckpt")
    assert max_diff(jax.device_get(state.params), init) == 0.0
    # A run's params resumed with a new optimizer: params= its checkpoint directory (the newest step) or a step.
    run = px.Trainer(Net(), optax.adam(1e-2), loss_fn, strategy=strategy, params=init, batch_size=16, max_steps=2,
                     shuffle=False, progress=False, checkpoint_dir=tmp_path / "run", checkpoint_every=1)
    trained = jax.device_get(run.fit({k: np.concatenate([b[k] for b in BATCHES]) for k in BATCHES[0]}).state.params)
    for given in (tmp_path / "run", tmp_path / "run" / "1"):
        state = px.init_state(Net(), tx, BATCHES[0], strategy=strategy, loss_fn=loss_fn, params=given)
        assert (max_diff(jax.device_get(state.params), trained) == 0.0) == (given.name == "run"), given
    assert tuple(state.params["Dense_0"]["kernel"].sharding.spec) != ()
    wrong = {**init, "Dense_1": {**init["Dense_1"], "kernel": np.zeros((64, 9), np.float32)}}
    with pytest.raises(ValueError, match=r"Dense_1/kernel is \(64, 9\) there but \(64, 8\) in the model"):
        px.init_state(Net(), tx, BATCHES[0], strategy=strategy, loss_fn=loss_fn, params=wrong)
    missing = {k: v for k, v in init.items() if k != "Embed_0"}
    with pytest.raises(ValueError, match=r"Embed_0/embedding \(32, 16\) is in the model but missing there"):
        px.init_state(Net(), tx, BATCHES[0], strategy=strategy, loss_fn=loss_fn, params=missing)
    with pytest.raises(ValueError, match="no such directory"):
        px.init_state(Net(), tx, BATCHES[0], strategy=strategy, loss_fn=loss_fn, params=tmp_path / "nothing")


def test_nnx_pretrained_state_and_fsdp_that_shards_nothing_warns():
    class Mlp(nnx.Module):
        def __init__(self, seed):
            self.a, self.b = nnx.Linear(4, 16, rngs=nnx.Rngs(seed)), nnx.Linear(16, 2, rngs=nnx.Rngs(seed + 1))

        def __call__(self, x):
            return self.b(nnx.relu(self.a(x)))

    def mse(model, batch):
        return ((model(batch["x"]) - batch["y"]) ** 2).mean()

    batch = {"x": np.ones((8, 4), np.float32), "y": np.zeros((8, 2), np.float32)}
    pretrained = Mlp(3)
    with pytest.warns(UserWarning,
                      match=r"FSDP\(fsdp=8\) splits only 0.0% of the train state.*min_weight_size=262,144"):
        state = px.init_state(Mlp(0), optax.sgd(0.1), batch, strategy=px.FSDP(split="largest"), loss_fn=mse,
                              params=nnx.state(pretrained, nnx.Param))
    assert max_diff(jax.device_get(state.params), nnx.to_pure_dict(nnx.state(pretrained, nnx.Param))) == 0.0
