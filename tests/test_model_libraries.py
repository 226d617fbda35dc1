"""Today's model libraries' own models, trained by parallax exactly like one device, through every entry point.

MaxText's decoder (the ``maxtext`` package: its NNX ``Transformer`` from its own ``from_config``, built against its
own mesh from its config's ``ici_*_parallelism``, under MaxText's default PRNG ``unsafe_rbg``, dropout on, inside
its ``logical_axis_rules`` and ``jax.set_mesh`` of its mesh, as MaxText's own train loop runs it) and Tunix's NNX
Llama 3, Qwen 3 and Gemma 3 (``google-tunix``: its ``ModelConfig`` classes, its ``fsdp`` / ``tp`` axis names): tiny
configs, random init, no downloads. Each run is compared with a plain one-device optax loop written here from the
same library's model built on one device, losses and final params (AdamW's params within each element's rounding
allowance, ``px.testing.rounding_allowance``, read off this loop's own gradients), and the user's module and
batches are checked after each entry point as in tests/test_user_objects.py.

Both libraries need the newest stack (Python >= 3.12; MaxText jax >= 0.11): ``make test-latest`` installs them (the
``libraries`` extra) and runs this whole file (marker ``libraries``) whatever a case's tier; on the default stack
it is skipped. Before, MaxText's decoder failed under FSDP's split search and FSDP x TP ("Cannot interpret
'key<fry>' as a data type", from the TP layout walk of its scanned layers' rng keys), and ``"auto"`` failed every
candidate with dropout on (JAX: "Context mesh ... must match the mesh passed to shardings ...": its shardings name
the mesh it was built against, which the search never used).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import parallax as px
from tests import tiers
from tests.reference import TOL, max_diff, snapshot

pytest.importorskip("tunix", reason="Tunix and MaxText install on the newest stack only: make test-latest")
pytest.importorskip("maxtext", reason="MaxText installs on the newest stack only: make test-latest")

import flax.linen as nn

# Importing MaxText's model_creation_utils replaces jax.lax.with_sharding_constraint and jax.lax.top_k process-wide
# (maxtext/integration/tunix/tunix_adapter.py: a fallback to reshard "for JAX 0.11.0+"): kept to this file's tests
# (its model is run with them, as MaxText runs it), JAX's own put back for the other files a worker runs after it.
_JAX_OWN = {name: getattr(jax.lax, name) for name in ("with_sharding_constraint", "top_k")}
from maxtext.configs import pyconfig  # noqa: E402
from maxtext.utils import maxtext_utils, model_creation_utils  # noqa: E402

_MAXTEXTS = {name: getattr(jax.lax, name) for name in _JAX_OWN}
for _name, _own in _JAX_OWN.items():
    setattr(jax.lax, _name, _own)
from tunix.models.gemma3 import model as gemma3  # noqa: E402
from tunix.models.llama3 import model as llama3  # noqa: E402
from tunix.models.qwen3 import model as qwen3  # noqa: E402

pytestmark = [pytest.mark.core, pytest.mark.libraries]

VOCAB, SEQ, ROWS, STEPS = 128, 16, 16, 3
TX = {"sgd": lambda: optax.sgd(0.1), "adamw": lambda: optax.adamw(3e-3, weight_decay=0.1)}
OPTIMIZER = {"dp": "sgd", "fsdp": "adamw", "fsdp+tp": "adamw", "auto": "adamw", "pp": "adamw", "cp": "adamw"}


def data() -> dict:
    rng = np.random.default_rng(0)
    return {"tokens": rng.integers(0, VOCAB, (ROWS * STEPS, SEQ + 1)).astype(np.int32)}


def batches() -> list[dict]:
    whole = data()["tokens"]
    return [{"tokens": whole[t * ROWS:(t + 1) * ROWS]} for t in range(STEPS)]


# MaxText: its config (the mesh it builds its model against is part of it), its model, its call.
MAXTEXT_MESH = {"dp": {"ici_data_parallelism": 8, "ici_fsdp_parallelism": 1},  # fsdp: its default (-1: every device)
                "fsdp+tp": {"ici_fsdp_parallelism": 4, "ici_tensor_parallelism": 2},
                "cp": {"ici_fsdp_parallelism": 4, "ici_context_parallelism": 2}}


@functools.cache
def maxtext_config(mesh: str = "") -> pyconfig.HyperParameters:
    """A 2-layer decoder of width 64 from MaxText's own base.yml, float32, dropout 0.1."""
    args = dict(run_name="parallax", base_emb_dim=64, base_num_query_heads=4, base_num_kv_heads=2, head_dim=16,
                base_mlp_dim=128, base_num_decoder_layers=2, vocab_size=VOCAB, max_target_length=SEQ,
                per_device_batch_size=1, dtype="float32", weight_dtype="float32", attention="dot_product",
                matmul_precision="highest", dropout_rate=0.1, enable_dropout=True, enable_checkpointing=False,
                skip_jax_distributed_system=True, **MAXTEXT_MESH.get(mesh, {}))
    base = os.path.join(os.path.dirname(pyconfig.__file__), "base.yml")
    return pyconfig.initialize(["parallax", base] + [f"{k}={v}" for k, v in args.items()])


def maxtext_loss(model, batch):
    tokens = batch["tokens"][:, :-1]
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    logits = model(tokens, positions, decoder_segment_ids=jnp.ones_like(tokens), enable_dropout=True)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()


# Tunix: its model configs and the call its own trainers make (tokens, positions, no cache, a causal mask).
TUNIX = {
    "tunix-llama3": lambda: llama3.Llama3(llama3.ModelConfig(
        num_layers=2, vocab_size=VOCAB, embed_dim=32, hidden_dim=64, num_heads=4, head_dim=8, num_kv_heads=2,
        rope_theta=10_000, norm_eps=1e-5), rngs=nnx.Rngs(0)),
    "tunix-qwen3": lambda: qwen3.Qwen3(qwen3.ModelConfig(
        num_layers=2, vocab_size=VOCAB, embed_dim=32, hidden_dim=64, num_heads=4, head_dim=8, num_kv_heads=2,
        rope_theta=10_000, norm_eps=1e-6), rngs=nnx.Rngs(0)),
    "tunix-gemma3": lambda: gemma3.Gemma3(gemma3.ModelConfig(
        num_layers=2, num_embed=VOCAB, embed_dim=32, hidden_dim=64, num_heads=4, head_dim=8, num_kv_heads=2,
        sliding_window_size=4, param_dtype=jnp.float32), rngs=nnx.Rngs(0)),
}


def tunix_loss(model, batch):
    tokens = batch["tokens"][:, :-1]
    length = tokens.shape[1]
    positions = jnp.broadcast_to(jnp.arange(length), tokens.shape)
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((length, length), bool)), (tokens.shape[0], length, length))
    logits, _ = model(tokens, positions, None, causal)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()


def strategy_for(kind: str, name: str):
    """The strategy a user of the library writes: Tunix names its tensor axis ``tp`` and keeps its decoder layers in
    a list (a pipeline names their class); MaxText's context split sits beside FSDP on its mesh."""
    tunix = kind.startswith("tunix")
    tensor = px.TensorParallel(2, axis="tp") if tunix else px.TensorParallel(2)
    return {"dp": px.DataParallel(), "fsdp": px.FSDP(), "auto": "auto",
            "fsdp+tp": px.combine(px.FSDP(4, min_weight_size=0), tensor),
            "pp": px.combine(px.PipelineParallel(2, blocks="DecoderLayer"), px.DataParallel(4)),
            "cp": px.combine(px.ContextParallel(2), px.DataParallel(4) if tunix else px.FSDP(4))}[name]


@contextlib.contextmanager
def prng_impl(name: str | None):
    """``jax_default_prng_impl`` set for the block (MaxText's own scripts set ``unsafe_rbg``), then put back."""
    before = jax.config.jax_default_prng_impl
    if name is not None:
        jax.config.update("jax_default_prng_impl", name)
    try:
        yield
    finally:
        jax.config.update("jax_default_prng_impl", before)


class Library:
    """One library model as its user holds it: the module (built on every device, against the library's mesh where
    it takes one), the loss, and the context the library trains it in (its mesh and logical axis rules)."""

    def __init__(self, kind: str, strategy_name: str):
        self.kind = kind
        if kind == "maxtext":
            self.config = maxtext_config("" if strategy_name == "auto" else strategy_name)
            self.mesh = maxtext_utils.get_mesh_from_config(self.config, jax.devices())
            self.loss_fn = maxtext_loss
        else:
            self.config, self.mesh, self.loss_fn = None, None, tunix_loss
        self.model = self.build(jax.devices())

    def build(self, devices) -> nnx.Module:
        if self.kind != "maxtext":
            return TUNIX[self.kind]()
        config = self.config if len(devices) > 1 else maxtext_config()  # one device: MaxText's default mesh of it
        mesh = maxtext_utils.get_mesh_from_config(config, devices)
        return model_creation_utils.from_config(config, mesh=mesh, rngs=nnx.Rngs(params=0, dropout=1))

    def context(self):
        """Where the library trains its model: MaxText inside ``jax.set_mesh`` of its mesh and its rules."""
        stack = contextlib.ExitStack()
        if self.mesh is not None:
            stack.enter_context(jax.set_mesh(self.mesh))
            stack.enter_context(nn.logical_axis_rules(self.config.logical_axis_rules))
        return stack

    def reference(self, tx_name: str) -> tuple[np.ndarray, dict, dict]:
        """The plain one-device loop: losses, final params, and each param element's rounding allowance."""
        rules = (contextlib.nullcontext() if self.config is None
                 else nn.logical_axis_rules(self.config.logical_axis_rules))
        with rules:  # MaxText's rules, not its mesh: the loop runs on one device
            return _reference(self.kind, tx_name, self)


def _reseeded(graphdef, params, rest, key):
    """The module's rng streams as parallax seeds them at a step (docs/guides/models.md, "Random numbers"): the
    ``dropout`` stream from the step's key, any other from its fold with the hash of the stream's name, a stream of
    stacked layers split into a key each."""
    module = nnx.merge(graphdef, params, rest)
    for stream in [node for _, node in nnx.iter_graph(module) if isinstance(node, nnx.RngStream)]:
        base = key if stream.tag == "dropout" else jax.random.fold_in(key, zlib.crc32(stream.tag.encode()) % 2**31)
        own = stream.key.get_value()
        new = jax.random.wrap_key_data(base, impl=jax.random.key_impl(own))
        if own.shape:
            new = jax.random.split(new, math.prod(own.shape)).reshape(own.shape)
        stream.key.set_value(new)
        stream.count.set_value(jnp.zeros_like(stream.count.get_value()))
    return nnx.to_pure_dict(nnx.split(module, nnx.Param, ...)[2])


_REFERENCES: dict = {}


def _reference(kind: str, tx_name: str, library: Library):
    if (kind, tx_name) in _REFERENCES:
        return _REFERENCES[kind, tx_name]
    device = jax.devices()[:1]
    graphdef, params, rest = nnx.split(library.build(device), nnx.Param, ...)
    params, rest = jax.device_put((nnx.to_pure_dict(params), nnx.to_pure_dict(rest)), device[0])
    tx, loss_fn = TX[tx_name](), library.loss_fn
    state_key = jax.random.split(jax.random.PRNGKey(0), 3)[2]  # the state's key from seed 0

    @jax.jit
    def grads_at(p, batch, key):
        seeded = _reseeded(graphdef, p, rest, key)
        return jax.value_and_grad(lambda p, r: loss_fn(nnx.merge(graphdef, p, r), batch))(p, seeded)

    @jax.jit
    def update(p, o, g):
        updates, o = tx.update(g, o, p)
        return optax.apply_updates(p, updates), o

    initial, opt_state = jax.device_get(params), tx.init(params)
    losses, grads, dithered = [], [], []
    for t, batch in enumerate(batches()):
        key = jax.random.fold_in(jax.random.fold_in(state_key, t), 0)
        value, g = grads_at(params, batch, key)
        dithered.append(jax.device_get(grads_at(jax.device_put(px.testing.dither(params), device[0]), batch, key)[1]))
        params, opt_state = update(params, opt_state, g)
        losses.append(float(value))
        grads.append(jax.device_get(g))
    allowance = px.testing.rounding_allowance(tx, initial, tx.init(initial), grads, dithered)
    _REFERENCES[kind, tx_name] = np.array(losses), jax.device_get(params), allowance
    return _REFERENCES[kind, tx_name]


def _train(library: Library, entry: str, strategy, tx, jax_batches: list) -> tuple[np.ndarray, dict]:
    if entry in ("fit", "auto"):
        trainer = px.Trainer(library.model, tx, library.loss_fn, strategy=strategy, batch_size=ROWS, max_steps=STEPS,
                             shuffle=False, progress=False, summary=False)
        state, history = trainer.fit(data())
        return np.array([row["loss"] for row in history.train]), jax.device_get(state.params)
    state = px.init_state(library.model, tx, jax_batches[0], strategy=strategy, loss_fn=library.loss_fn)
    step, losses = px.make_train_step(library.loss_fn, strategy), []
    for batch in jax_batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return np.array(losses), jax.device_get(state.params)


ENTRIES = ["fit", "init_state", "plan", "assert_equivalent"]
GRID = [(kind, entry, strategy) for kind in ("maxtext", "tunix-llama3") for entry in ENTRIES
        for strategy in ("dp", "fsdp", "fsdp+tp")]
GRID += [("maxtext", "auto", "auto"), ("tunix-llama3", "auto", "auto"), ("tunix-qwen3", "fit", "fsdp+tp"),
         ("tunix-gemma3", "fit", "fsdp+tp"), ("tunix-llama3", "fit", "pp"), ("tunix-llama3", "fit", "cp"),
         ("maxtext", "fit", "cp")]
# Not here: parallax's pipeline over MaxText's decoder. A MaxText config with a stage axis (ici_pipeline_parallelism)
# builds MaxText's own pipeline into the model, and one without has no stage axis on the mesh the model is built
# against, so PipelineParallel is refused there ("does not fit the strategy"): MaxText pipelines itself.
CORE = [("maxtext", "fit", "fsdp+tp"), ("maxtext", "init_state", "fsdp"), ("tunix-llama3", "plan", "fsdp"),
        ("maxtext", "assert_equivalent", "dp"), ("maxtext", "auto", "auto"), ("tunix-llama3", "init_state", "fsdp+tp")]


@pytest.fixture(autouse=True)
def maxtexts_jax(monkeypatch):
    """jax.lax as MaxText leaves it once imported, for this file's tests only."""
    for name, patched in _MAXTEXTS.items():
        monkeypatch.setattr(jax.lax, name, patched)


@pytest.fixture(autouse=True)
def first_run(monkeypatch, tmp_path):
    """No timings cached, so that the split search and ``"auto"`` build and time their candidates."""
    monkeypatch.setenv("PARALLAX_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("kind, entry, strategy_name", tiers.cases(
    GRID, CORE, "the grid's other cells: the core tier runs each entry point once, on both libraries"))
def test_a_model_librarys_own_model_trains_like_one_device(kind, entry, strategy_name):
    with prng_impl("unsafe_rbg" if kind == "maxtext" else None):  # MaxText's default PRNG: keys of shape (4,)
        library = Library(kind, strategy_name)
        strategy = strategy_for(kind, strategy_name)
        tx = TX[OPTIMIZER[strategy_name]]()
        module_before = snapshot(nnx.state(library.model))
        jax_batches = [jax.tree.map(jnp.asarray, b) for b in batches()]
        batch_arrays = jax.tree.leaves(jax_batches)
        batch_before = snapshot(batch_arrays)
        trained = None
        with library.context():
            if entry == "plan":
                (row,) = px.plan(library.model, tx, batches()[0], loss_fn=library.loss_fn, strategies=[strategy]).rows
                assert row["error"] is None and row["peak"] > 0 and row["state"]["total"] > 0, row
            elif entry == "assert_equivalent":
                report = px.testing.assert_equivalent(library.model, tx, library.loss_fn, batches(), strategy)
                assert report.strategy.startswith(strategy.describe().split("(")[0]), report
            else:
                losses, params = _train(library, entry, strategy, tx, jax_batches)
        if entry not in ("plan", "assert_equivalent"):
            ref_losses, ref_params, allowance = library.reference(OPTIMIZER[strategy_name])
            assert np.abs(losses - ref_losses).max() <= TOL, (losses, ref_losses)
            beyond = px.testing.excess(params, ref_params, allowance)
            assert max(beyond.values()) <= TOL, sorted(beyond.items(), key=lambda kv: -kv[1])[:3]
            trained = params if entry in ("fit", "auto") else None
        # The user's module: alive, and unchanged (or, after the Trainer, holding the trained params: NNX's way).
        leaves = jax.tree.leaves(nnx.state(library.model))
        assert not [x.shape for x in leaves if isinstance(x, jax.Array) and x.is_deleted()], (
            "the module's arrays deleted")
        if trained is None:
            for a, b in zip(snapshot(nnx.state(library.model)), module_before, strict=True):
                np.testing.assert_array_equal(a, b)
        else:
            assert max_diff(jax.device_get(nnx.to_pure_dict(nnx.state(library.model, nnx.Param))), trained) == 0.0
        assert not any(x.is_deleted() for x in batch_arrays)
        for a, b in zip(batch_arrays, batch_before, strict=True):
            np.testing.assert_array_equal(np.array(a), b)


def test_a_model_built_against_another_mesh_is_refused_naming_the_mesh_to_train_on():
    """MaxText's decoder (built against its fsdp=8 mesh, dropout on) trained on a mesh of parallax's own
    (``DataParallel(8)``'s data=8, no ``jax.set_mesh``): refused with the fix, not JAX's "Context mesh ... must
    match the mesh passed to shardings ...". A pipeline on its mesh, which has no stage axis: refused naming it."""
    with prng_impl("unsafe_rbg"):
        library = Library("maxtext", "fsdp")
        with nn.logical_axis_rules(library.config.logical_axis_rules), pytest.raises(ValueError) as raised:
            px.init_state(library.model, TX["sgd"](), batches()[0], strategy=px.DataParallel(), loss_fn=maxtext_loss)
        with library.context(), pytest.raises(ValueError) as pipelined:  # MaxText's mesh has no stage axis to pipeline
            px.init_state(library.model, TX["sgd"](), batches()[0], loss_fn=maxtext_loss,
                          strategy=px.combine(px.PipelineParallel(2), px.FSDP(4)))
    message = str(raised.value)
    assert "the mesh it was built against (fsdp=8" in message and "jax.set_mesh" in message, message
    assert "(data=8)" in message and "Context mesh" not in message, message
    assert "Mesh axis 'stage' has size 1 but the strategy asks for 2" in str(pipelined.value), pipelined.value


def test_the_docs_maxtext_example_runs():
    """docs/guides/models.md's MaxText block, as written, on this file's config, loss and data."""
    import re
    import textwrap

    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "guides", "models.md")) as f:
        page = f.read()
    (block,) = re.findall(r"```python maxtext\n(.*?)```", page, re.S)
    scope = {"jax": jax, "nnx": nnx, "nn": nn, "optax": optax, "px": px, "config": maxtext_config(),
             "loss_fn": maxtext_loss, "data": data()}
    with prng_impl("unsafe_rbg"):
        exec(compile(textwrap.dedent(block), "docs/guides/models.md", "exec"), scope)
    assert len(scope["history"].train) >= 1 and np.isfinite(scope["history"].train[-1]["loss"])
