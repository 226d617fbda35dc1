"""parallax with default arguments against what users would pick instead, timed side by side.

    python -m benchmarks.peers                        # 8 simulated CPU devices, MLP, LM and CNN
    python -m benchmarks.peers --models mlp --rounds 5
    python -m benchmarks.peers --peers keras          # skip google-parallax
    python -m benchmarks.peers --smoke                # tiny models, one round: checks it still runs

Peers (each optional: a peer that is not installed is reported as missing, not fatal):

- Keras 3 on the JAX backend (``KERAS_BACKEND=jax``, ``pip install -e '.[bench]'``):
  ``keras.distribution.DataParallel``, and ``ModelParallel`` with a ``LayoutMap`` laid out
  three ways: kernels split FSDP-like over the batch axis of a 1-D mesh of 8 (each weight of
  at least 2**14 elements on its largest dim that divides evenly, the threshold parallax's FSDP
  rows use), Megatron tensor parallelism on a (batch 1, model 8) mesh (up kernels on their
  output dim, down kernels on their input dim, attention on heads) and the same on a
  (batch 4, model 2) mesh. Each layout is timed twice: ``model.train_on_batch(x, y)`` with
  numpy inputs (what a Keras user calls; it places the batch, runs Keras's jitted step and
  syncs the variables back each call), and Keras's own ``train_step`` jitted as Keras jits it
  (``donate_argnums=0``, its state shardings) and called on a placed batch, with no
  ``train_on_batch`` wrapping.
- Google's ``google-parallax`` (NNX; ``make bench-peers`` installs it into ``.bench-peers/``,
  outside any environment, because it also installs a top-level ``parallax`` module). It is
  loaded under a temporary ``sys.modules`` swap and reached as ``GP`` here. Its
  ``create_sharded_model`` on the NNX twins of the models (``benchmarks/nnx_models.py``; the
  CNN's twin is below), then ``nnx.Optimizer`` and an ``nnx.jit`` step, as its tests do:
  ``ShardingStrategy.DDP`` on a mesh of 8, ``FSDP`` on a 1-D mesh of 8 (its data and model
  axis names both the one axis), ``FSDP`` and ``AUTO`` (its default) on ``auto_mesh()``
  (4 data × 2 model), and ``AUTO`` on (1 data × 8 model).
- parallax (this checkout) with default arguments: ``px.init_state(model, optax.adam(1e-3),
  batch, strategy=S, loss_fn=loss_fn)`` and ``px.make_train_step(loss_fn, S)`` called as
  ``step(state, batch)``, S as ``benchmarks.run.make_strategy`` builds it, plus ``dp+tp``
  (``combine(DataParallel(4), TensorParallel(2))``: the peers' 4 × 2 layouts) and, in that
  group, ``combine(DataParallel(4), FSDP(2))`` (the 4 × 2 mesh with FSDP on its second axis,
  what google-parallax's FSDP on ``auto_mesh()`` lays out).

Same work everywhere: the same network (Keras written to match ``benchmarks/models.py``), batch
(``benchmarks.run.BATCH``), float32, Adam (lr 1e-3, eps 1e-8), mean softmax cross-entropy.
Every configuration is run interleaved in one process in a new random order each round.
Reported per configuration: median step time, the ratio to parallax-default of the same
strategy kind round by round, median (min–max); train-state bytes per device (params,
optimizer state and model state such as batch-norm statistics, from the real arrays' first
shard); the compiled step's collective bytes (from its HLO). Results go to
``benchmarks/results/peers.{json,md}``.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import os
import re
import sys
import time
import traceback

from benchmarks import report, side_runner_args, time_interleaved

ARGS = side_runner_args(__doc__, models="mlp,lm,cnn", peers="keras,google", strategies="dp,fsdp,tp,dp+tp") \
    if __name__ == "__main__" else None

os.environ.setdefault("KERAS_BACKEND", "jax")

import statistics  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import parallax as px  # noqa: E402
from benchmarks import nnx_models  # noqa: E402
from benchmarks.models import build, make_batch  # noqa: E402
from benchmarks.run import BATCH, MB, MIN_WEIGHT_SIZE, make_strategy, round_ratios  # noqa: E402
from parallax.inspect import collective_bytes, state_bytes_per_device  # noqa: E402

PEERS_DIR = os.path.join(ROOT, ".bench-peers")
LR, EPS = 1e-3, 1e-8
KINDS = ("dp", "fsdp", "tp", "dp+tp", "dp+fsdp", "fsdp+tp")


def first_shard_bytes(arrays) -> int:
    """Bytes the first device holds of ``arrays`` (every device holds the same share here)."""
    return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(arrays)
               if isinstance(leaf, jax.Array))


def collectives_of(hlo_text: str) -> dict:
    return {k: vars(v) for k, v in collective_bytes(hlo_text).items() if v.count}


class Runner:
    """One configuration: ``run()`` does one step and returns its seconds; ``times`` collects them."""

    framework = label = kind = notes = ""

    def __init__(self):
        self.times: list[float] = []
        self.collectives: dict | None = None
        self.first_loss = float("nan")
        self.compile_s = float("nan")

    @property
    def median_s(self) -> float:
        return statistics.median(self.times)

    def state_bytes(self) -> int:
        raise NotImplementedError


# --- parallax ----------------------------------------------------------------------------------


def parallax_strategy(kind: str, rules) -> px.Strategy:
    if kind == "dp+tp":
        return px.combine(px.DataParallel(4), px.TensorParallel(-1, rules=rules))
    return make_strategy(kind, rules if "tp" in kind else None)


class Parallax(Runner):
    framework = "parallax"

    def __init__(self, kind: str, model, loss_fn, rules, batch, strategy=None, label="default"):
        super().__init__()
        self.kind, self.label = kind, label
        strategy = parallax_strategy(kind, rules) if strategy is None else strategy
        self.notes = strategy.describe() if hasattr(strategy, "describe") else ""
        mesh = strategy.make_mesh()
        self.state = px.init_state(model, optax.adam(LR, eps=EPS), batch, strategy=strategy, loss_fn=loss_fn,
                                   mesh=mesh)
        self.step = px.make_train_step(loss_fn, strategy)
        self.batch = px.data.to_global(batch, NamedSharding(mesh, strategy.batch_spec()))
        self.collectives = collectives_of(self.step.lower(self.state, self.batch).compile().as_text())
        start = time.perf_counter()
        self.state, metrics = self.step(self.state, self.batch)
        self.first_loss = float(metrics["loss"])
        self.compile_s = time.perf_counter() - start
        self.notes = f"{self.step.mode()}; {self.notes}"

    def run(self) -> float:
        start = time.perf_counter()
        self.state, metrics = self.step(self.state, self.batch)
        jax.block_until_ready((self.state, metrics))
        return time.perf_counter() - start

    def state_bytes(self) -> int:
        return state_bytes_per_device(self.state)


# --- Keras 3 -----------------------------------------------------------------------------------


def import_keras():
    try:
        import keras
    except ImportError as error:
        return None, f"keras not importable ({error}); pip install -e '.[bench]'"
    if keras.backend.backend() != "jax":
        return None, f"keras runs on backend {keras.backend.backend()!r}; set KERAS_BACKEND=jax"
    return keras, None


def keras_model(keras, kind: str, scale: float):
    """The benchmark network of ``kind`` in Keras, every weighted layer named (layouts go by path)."""
    layers = keras.layers
    if kind == "mlp":
        features, hidden = int(768 * scale), int(3072 * scale)
        x = inputs = keras.Input((features,), name="x")
        for index in range(2):
            h = layers.Dense(hidden, activation="relu", name=f"up_{index}")(x)
            x = layers.Add(name=f"res_{index}")([x, layers.Dense(features, name=f"down_{index}")(h)])
        return keras.Model(inputs, layers.Dense(10, name="head")(x))
    if kind == "lm":
        width = max(32, int(256 * scale))
        heads, length = (8 if width >= 64 else 4), int(64 * scale)
        gelu = lambda t: keras.activations.gelu(t, approximate=True)  # flax's default
        tokens = keras.Input((length,), dtype="int32", name="tokens")
        x = layers.Embedding(512, width, name="embed")(tokens)
        for index in range(2):
            h = layers.LayerNormalization(epsilon=1e-6, name=f"ln0_{index}")(x)
            h = layers.MultiHeadAttention(heads, width // heads, name=f"attn_{index}")(h, h, use_causal_mask=True)
            x = layers.Add(name=f"res0_{index}")([x, h])
            h = layers.LayerNormalization(epsilon=1e-6, name=f"ln1_{index}")(x)
            h = layers.Dense(4 * width, activation=gelu, name=f"up_{index}")(h)
            x = layers.Add(name=f"res1_{index}")([x, layers.Dense(width, name=f"down_{index}")(h)])
        x = layers.LayerNormalization(epsilon=1e-6, name="ln_f")(x)
        return keras.Model(tokens, layers.Dense(512, name="head")(x))
    if kind == "cnn":
        side = max(8, int(32 * scale))
        x = inputs = keras.Input((side, side, 3), name="images")
        for index, width in enumerate((32, 64, 128)):
            x = layers.Conv2D(width, 3, padding="same", use_bias=False, name=f"conv_{index}")(x)
            x = layers.BatchNormalization(momentum=0.9, epsilon=1e-5, name=f"bn_{index}")(x)
            x = layers.MaxPooling2D(2, name=f"pool_{index}")(layers.ReLU(name=f"relu_{index}")(x))
        x = layers.GlobalAveragePooling2D(name="gap")(x)
        return keras.Model(inputs, layers.Dense(10, name="head")(x))
    raise ValueError(kind)


def keras_xy(kind: str, batch: dict) -> tuple[np.ndarray, np.ndarray]:
    if kind == "lm":
        return batch["x"][:, :-1], batch["x"][:, 1:]
    return batch["x"], batch["y"]


def tp_dim(kind: str, path: str, shape) -> int | None:
    """Megatron layout: which dim of ``path`` the model axis splits (None: replicated)."""
    if kind == "cnn":  # as benchmarks.models.build's rules: conv 1 on its output dim, conv 2 on its input dim
        return {"conv_1/kernel": 3, "conv_2/kernel": 2}.get(path)
    if re.fullmatch(r"up_\d+/kernel", path):
        return 1
    if re.fullmatch(r"up_\d+/bias", path):
        return 0
    if re.fullmatch(r"down_\d+/kernel", path):
        return 0
    if re.fullmatch(r"attn_\d+/(query|key|value)/kernel", path):  # (features, heads, head_dim)
        return 1
    if re.fullmatch(r"attn_\d+/(query|key|value)/bias", path):  # (heads, head_dim)
        return 0
    if re.fullmatch(r"attn_\d+/attention_output/kernel", path):  # (heads, head_dim, features)
        return 0
    return None


def fsdp_dim(kind: str, path: str, shape, devices: int) -> int | None:
    """FSDP-like layout: the largest dim that splits evenly, for weights of at least MIN_WEIGHT_SIZE."""
    if int(np.prod(shape)) < MIN_WEIGHT_SIZE:
        return None
    dims = [d for d in np.argsort(shape)[::-1] if shape[d] % devices == 0]
    return int(dims[0]) if dims else None


KERAS_LAYOUTS = {
    # label: (strategy kind, mesh shape (batch, model), layout: "replicated" / "fsdp" / "tp")
    "DataParallel": ("dp", (8, 1), "replicated"),
    "ModelParallel FSDP-like (batch 8)": ("fsdp", (8, 1), "fsdp"),
    "ModelParallel TP (batch 1 × model 8)": ("tp", (1, 8), "tp"),
    "ModelParallel TP (batch 4 × model 2)": ("dp+tp", (4, 2), "tp"),
}


def keras_distribution(keras, kind: str, scale: float, shape: tuple[int, int], layout: str):
    devices = jax.devices()
    if layout == "replicated":
        return keras.distribution.DataParallel(devices=devices), "replicated variables"
    mesh = keras.distribution.DeviceMesh(shape, ["batch", "model"], devices)
    axis, size = ("batch", shape[0]) if layout == "fsdp" else ("model", shape[1])
    layout_map = keras.distribution.LayoutMap(mesh)
    probe = keras_model(keras, kind, scale)  # no distribution: just the variable paths and shapes
    split = 0
    for variable in probe.weights:
        shape_v = tuple(variable.shape)
        dim = fsdp_dim(kind, variable.path, shape_v, size) if layout == "fsdp" else tp_dim(kind, variable.path, shape_v)
        if dim is None or shape_v[dim] % size:
            continue
        spec = [None] * len(shape_v)
        spec[dim] = axis
        layout_map[variable.path] = tuple(spec)
        split += 1
    del probe
    return (keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"),
            f"{split} of the variables split over {axis!r}")


class Keras(Runner):
    """``model.train_on_batch`` (``compiled=False``) or Keras's jitted ``train_step`` called directly."""

    framework = "keras"

    def __init__(self, keras, kind: str, label: str, model_kind: str, scale: float, batch: dict, compiled: bool):
        super().__init__()
        self.keras, self.kind, self.compiled = keras, kind, compiled
        self.label = f"{label}, {'jitted train_step' if compiled else 'train_on_batch'}"
        _, shape, layout = KERAS_LAYOUTS[label]
        self.distribution, self.notes = keras_distribution(keras, model_kind, scale, shape, layout)
        self.x, self.y = keras_xy(model_kind, batch)
        keras.utils.set_random_seed(0)
        with self.distribution.scope():
            self.model = keras_model(keras, model_kind, scale)
            self.model.compile(optimizer=keras.optimizers.Adam(LR, epsilon=EPS),
                               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            start = time.perf_counter()
            self.first_loss = float(self.model.train_on_batch(self.x, self.y))  # builds the optimizer's variables
            self.compile_s = time.perf_counter() - start
            model = self.model
            # What make_train_function jits (keras/src/backend/jax/trainer.py).
            self.step = jax.jit(model.train_step, donate_argnums=0,
                                out_shardings=(None, model._get_state_sharding_spec()))
            self.state = model._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                              optimizer_variables=True, metrics_variables=True)
            from keras.src.backend.jax.trainer import _distribute_data
            self.data = _distribute_data((self.x, self.y, None))
            lowered = self.step.lower(self.state, self.data)
        self.collectives = collectives_of(lowered.compile().as_text())
        if compiled:
            self.notes += "; Keras's step without train_on_batch"
            _, self.state = self.step(self.state, self.data)
        else:
            self.notes += "; numpy batch placed each call"
            del self.step, self.state, self.data

    def run(self) -> float:
        if self.compiled:
            start = time.perf_counter()
            logs, self.state = self.step(self.state, self.data)
            jax.block_until_ready((logs, self.state))
            return time.perf_counter() - start
        with self.distribution.scope():
            start = time.perf_counter()
            self.model.train_on_batch(self.x, self.y)  # returns python floats: waits for the step
            jax.block_until_ready([v.value for v in self.model.trainable_variables])
            return time.perf_counter() - start

    def state_bytes(self) -> int:
        if self.compiled:
            return first_shard_bytes(self.state[:3])
        model = self.model
        return first_shard_bytes([v.value for v in (*model.trainable_variables, *model.non_trainable_variables,
                                                    *model.optimizer.variables)])


# --- google-parallax ---------------------------------------------------------------------------


def import_google_parallax():
    """google-parallax from ``.bench-peers/google_parallax`` (its deps from ``.bench-peers/deps``),
    imported as ``parallax`` with ours set aside, then ours put back: ``(module, None)`` or
    ``(None, why not)``."""
    home, deps = os.path.join(PEERS_DIR, "google_parallax"), os.path.join(PEERS_DIR, "deps")
    if not os.path.isfile(os.path.join(home, "parallax", "__init__.py")):
        return None, f"google-parallax not installed in {home}; run `make bench-peers`"
    ours = {name: sys.modules.pop(name) for name in list(sys.modules)
            if name == "parallax" or name.startswith("parallax.")}
    # parallax-flax's import guard refuses any other `parallax`: stand it aside for this one import.
    guards = [finder for finder in sys.meta_path if type(finder).__name__ == "ParallaxGuard"]
    for finder in guards:
        sys.meta_path.remove(finder)
    added = [path for path in (home, deps) if os.path.isdir(path)]
    sys.path[:0] = added
    try:
        module = importlib.import_module("parallax")
        if getattr(module, "__distribution__", None) == "parallax-flax":
            raise ImportError("found parallax-flax again, not google-parallax")
        error = None
    except Exception as exc:
        module, error = None, f"google-parallax did not import: {type(exc).__name__}: {exc}"
    finally:
        theirs = {name: sys.modules.pop(name) for name in list(sys.modules)
                  if name == "parallax" or name.startswith("parallax.")}
        for path in added:
            sys.path.remove(path)
        sys.meta_path[:0] = guards
        sys.modules.update(ours)
        sys.modules.update({"google_parallax" + name[len("parallax"):]: mod for name, mod in theirs.items()})
    return module, error


class NNXCNN(nnx.Module):
    """``benchmarks.models.CNN`` in NNX (``benchmarks/nnx_models.py`` has the MLP and the LM)."""

    def __init__(self, rngs: nnx.Rngs):
        widths = (3, 32, 64, 128)
        self.convs = nnx.List([nnx.Conv(a, b, (3, 3), use_bias=False, rngs=rngs)
                               for a, b in itertools.pairwise(widths)])
        self.norms = nnx.List([nnx.BatchNorm(b, momentum=0.9, rngs=rngs) for b in widths[1:]])
        self.head = nnx.Linear(128, 10, rngs=rngs)

    def __call__(self, x):
        for conv, norm in zip(self.convs, self.norms):
            x = nnx.max_pool(nnx.relu(norm(conv(x))), (2, 2), strides=(2, 2))
        return self.head(x.mean(axis=(1, 2)))


def nnx_build(kind: str, scale: float):
    if kind == "cnn":
        return lambda: NNXCNN(nnx.Rngs(0)), nnx_models.classifier_loss
    return nnx_models.build(kind, scale)


GOOGLE_LAYOUTS = {
    # label: (strategy kind, ShardingStrategy name, mesh shape, axis names, create_sharded_model kwargs)
    "DDP (data 8)": ("dp", "DDP", (8,), ("data",), {}),
    "FSDP (data 8)": ("fsdp", "FSDP", (8,), ("data",), {"model_axis_name": "data"}),
    "FSDP, auto_mesh (data 4 × model 2)": ("dp+tp", "FSDP", (4, 2), ("data", "model"), {}),
    "AUTO, auto_mesh (data 4 × model 2)": ("dp+tp", "AUTO", (4, 2), ("data", "model"), {}),
    "AUTO (data 1 × model 8)": ("tp", "AUTO", (1, 8), ("data", "model"), {}),
}


class Google(Runner):
    """``create_sharded_model`` + ``nnx.Optimizer`` + an ``nnx.jit`` step, under ``jax.set_mesh``."""

    framework = "google-parallax"

    def __init__(self, gp, label: str, model_kind: str, scale: float, batch: dict):
        super().__init__()
        self.kind, strategy, shape, names, kwargs = GOOGLE_LAYOUTS[label]
        self.label = label
        build_fn, loss_fn = nnx_build(model_kind, scale)
        self.mesh = jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))
        inputs = batch["x"][:, :-1] if model_kind == "lm" else batch["x"]
        with jax.set_mesh(self.mesh):
            self.model = gp.create_sharded_model(build_fn, sample_inputs=(jnp.asarray(inputs),),
                                                 strategy=gp.ShardingStrategy[strategy], **kwargs)
            self.optimizer = nnx.Optimizer(self.model, optax.adam(LR, eps=EPS), wrt=nnx.Param)

            self.step = step = nnx_models.train_step(loss_fn)
            self.batch = jax.device_put(batch, NamedSharding(self.mesh, P(names[0])))
            split = sum(1 for leaf in jax.tree.leaves(nnx.state(self.model, nnx.Param))
                        if any(leaf.sharding.spec))
            self.notes = f"{split} params split"
            try:
                self.collectives = collectives_of(
                    step.lower(self.model, self.optimizer, self.batch).compile().as_text())
            except Exception as exc:
                self.notes += f"; no HLO ({type(exc).__name__})"
            start = time.perf_counter()
            self.first_loss = float(step(self.model, self.optimizer, self.batch))
            self.compile_s = time.perf_counter() - start

    def run(self) -> float:
        with jax.set_mesh(self.mesh):
            start = time.perf_counter()
            loss = self.step(self.model, self.optimizer, self.batch)
            jax.block_until_ready((loss, nnx.state(self.model)))
            return time.perf_counter() - start

    def state_bytes(self) -> int:
        return first_shard_bytes((nnx.state(self.model), nnx.state(self.optimizer)))


# --- the comparison ----------------------------------------------------------------------------


def bench(kind: str, kinds: list[str], peers: dict, rounds: int, scale: float) -> tuple[list[dict], list[str]]:
    model, loss_fn, rules = build(kind, scale)
    batch = make_batch(kind, BATCH[kind], scale)
    runners, failed = [], []

    def attempt(what: str, make, *args):
        try:
            runners.append(make(*args))
        except Exception as exc:
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            where = f"{os.path.relpath(frame.filename, ROOT) if frame.filename.startswith(ROOT) else frame.filename}" \
                    f":{frame.lineno} ({frame.name})"
            message = str(exc).splitlines()[0][:200] if str(exc) else ""
            failed.append(f"{kind}: {what}: {type(exc).__name__} at {where}: {message}")
            traceback.print_exc(limit=3)
        print(f"{kind}: built {what}", flush=True)

    for name in kinds:
        attempt(f"parallax {name}", Parallax, name, model, loss_fn, rules, batch)
    if "dp+tp" in kinds:  # the 4 x 2 mesh with FSDP on the second axis: google-parallax's FSDP on auto_mesh
        hybrid = px.combine(px.DataParallel(4), px.FSDP(-1, min_weight_size=MIN_WEIGHT_SIZE))
        attempt("parallax DP(4) × FSDP(2)", Parallax, "dp+tp", model, loss_fn, rules, batch, hybrid,
                "DataParallel(4) × FSDP(2), default arguments")
    if peers.get("keras"):
        for label, (strategy_kind, _, _) in KERAS_LAYOUTS.items():
            if strategy_kind in kinds:
                for compiled in (False, True):
                    attempt(f"keras {label}", Keras, peers["keras"], strategy_kind, label, kind, scale, batch, compiled)
    if peers.get("google"):
        for label, (strategy_kind, *_) in GOOGLE_LAYOUTS.items():
            if strategy_kind in kinds:
                attempt(f"google-parallax {label}", Google, peers["google"], label, kind, scale, batch)
    time_interleaved(runners, rounds)
    reference = {r.kind: r for r in runners if r.framework == "parallax" and r.label == "default"}
    results = []
    for runner in runners:
        ref = reference.get(runner.kind)
        results.append({
            "model": kind, "framework": runner.framework, "config": runner.label, "kind": runner.kind,
            "ms": 1e3 * runner.median_s, "times_ms": [1e3 * t for t in runner.times],
            "vs_parallax": round_ratios(runner, ref) if ref is not None else None,
            "state_bytes": runner.state_bytes(),
            "collective_bytes": (None if runner.collectives is None
                                 else sum(s["bytes"] for s in runner.collectives.values())),
            "collectives": runner.collectives, "first_loss": runner.first_loss, "compile_s": runner.compile_s,
            "notes": runner.notes,
        })
    return results, failed


def markdown(results: list[dict], meta: dict) -> str:
    lines = [(f"# parallax (default arguments) against Keras 3 and google-parallax ({meta['devices']} "
              f"{meta['platform']} devices, jax {meta['jax']}, {meta['rounds']} rounds, Adam; "
              f"parallax {meta['parallax']})"), "",
             ("Ratios are step time over parallax-default of the same strategy kind, round by round: "
              "median (min–max); below 1 the peer is faster. State: params + optimizer state + model state "
              "per device, from the arrays' first shard. Peers: ")
             + "; ".join(f"{k} {v}" for k, v in meta["peers"].items()),
             ""]
    for model in dict.fromkeys(r["model"] for r in results):
        lines += [f"## {model} (batch {meta['batch'][model]})", "",
                  ("| framework | configuration | kind | ms | vs parallax default | state MB/dev | collective MB | "
                   "first loss | notes |"), "| --- | --- | --- | ---: | --- | ---: | ---: | ---: | --- |"]
        rows = sorted((r for r in results if r["model"] == model), key=lambda r: (KINDS.index(r["kind"]),
                                                                                    r["framework"] != "parallax"))
        for r in rows:
            v = r["vs_parallax"]
            ratio = f"{v['median']:.2f} ({v['min']:.2f}–{v['max']:.2f})" if v else ""
            moved = "" if r["collective_bytes"] is None else f"{r['collective_bytes'] / MB:.1f}"
            lines.append(f"| {r['framework']} | {r['config']} | {r['kind']} | {r['ms']:.1f} | {ratio} "
                         f"| {r['state_bytes'] / MB:.2f} | {moved} | {r['first_loss']:.3f} | {r['notes']} |")
        lines.append("")
    if meta["failed"]:
        lines += ["## Did not run", ""] + [f"- {line}" for line in meta["failed"]] + [""]
    return "\n".join(lines)


def git_state() -> str:
    """This checkout's commit, ``+dirty`` when parallax/ has uncommitted changes (the code timed)."""
    import subprocess

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "parallax"], cwd=ROOT, capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def main(args: argparse.Namespace) -> None:
    wanted = args.peers.split(",") if args.peers else []
    peers, versions, failed = {}, {}, []
    if "keras" in wanted:
        keras, why = import_keras()
        if keras is None:
            failed.append(f"keras: {why}")
        else:
            peers["keras"], versions["keras"] = keras, keras.__version__
    if "google" in wanted:
        gp, why = import_google_parallax()
        if gp is None:
            failed.append(f"google-parallax: {why}")
        else:
            peers["google"], versions["google-parallax"] = gp, getattr(gp, "__version__", "?")
    assert px.__distribution__ == "parallax-flax", px.__file__
    kinds = args.strategies.split(",")
    results = []
    for kind in args.models.split(","):
        rows, broken = bench(kind, kinds, peers, args.rounds, args.scale)
        results.extend(rows)
        failed.extend(broken)
        print(f"{kind}: done", flush=True)
    report(args, "peers", results, markdown, peers=versions, batch=BATCH, failed=failed, threshold=MIN_WEIGHT_SIZE,
           parallax=git_state())


if __name__ == "__main__":
    main(ARGS)
