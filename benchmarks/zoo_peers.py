"""Peers on zoo models, where they express the same plan as a parallax kind (``benchmarks/zoo.py``).

- google-parallax (``make bench-peers``) on the NNX members: ``ShardingStrategy.DDP`` (kind
  ``dp``) and ``FSDP`` on a 1-D mesh of 8 (kind ``fsdp``), ``create_sharded_model`` +
  ``nnx.Optimizer(optax.adamw)`` + an ``nnx.jit`` step, as in ``benchmarks/peers.py``.
- Keras 3 (``pip install -e '.[bench]'``, ``KERAS_BACKEND=jax``) on the MLP stacks (the same
  Dense widths, ReLU, a 10-class head, AdamW): ``DataParallel`` (kind ``dp``) and ``ModelParallel``
  with each kernel of at least 2**14 elements split on its largest dim over the batch axis
  (kind ``fsdp``), Keras's jitted ``train_step`` called on a placed batch.

A peer that is not installed is left out (the zoo's table says which ran).
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import nnx_models
from benchmarks.peers import (
    Google,
    Runner,
    collectives_of,
    first_shard_bytes,
    fsdp_dim,
    import_google_parallax,
    import_keras,
)
from benchmarks.zoo_models import Member

_GOOGLE: list = []  # the google-parallax module, imported once per process (a module swap)


def _google():
    if not _GOOGLE:
        _GOOGLE.append(import_google_parallax()[0])
    return _GOOGLE[0]


def _inputs(member: Member):
    return member.batch["x"][:, :-1] if member.family in ("lm", "moe") else member.batch["x"]


class GoogleZoo(Google):
    """google-parallax on a zoo member: ``peers.Google``'s step and timing, the member's model and loss."""

    def __init__(self, gp, member: Member, kind: str):
        Runner.__init__(self)
        strategy, kwargs = {"dp": ("DDP", {}), "fsdp": ("FSDP", {"model_axis_name": "data"})}[kind]
        self.kind, self.label = kind, f"google-parallax {strategy}"
        self.mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
        with jax.set_mesh(self.mesh):
            self.model = gp.create_sharded_model(member.build, sample_inputs=(jnp.asarray(_inputs(member)),),
                                                 strategy=gp.ShardingStrategy[strategy], **kwargs)
            self.optimizer = nnx.Optimizer(self.model, optax.adamw(1e-3), wrt=nnx.Param)
            self.step = nnx_models.train_step(member.loss_fn)
            self.batch = jax.device_put(member.batch, NamedSharding(self.mesh, P("data")))
            start = time.perf_counter()
            self.first_loss = float(self.step(self.model, self.optimizer, self.batch))
            self.compile_s = time.perf_counter() - start
        split = sum(1 for x in jax.tree.leaves(nnx.state(self.model, nnx.Param)) if any(x.sharding.spec))
        self.notes = f"{split} params split"


def keras_stack(keras, inputs: int, widths):
    layers = keras.layers
    x = first = keras.Input((inputs,), name="x")
    for index, width in enumerate(widths):
        x = layers.Dense(width, activation="relu", name=f"dense_{index}")(x)
    return keras.Model(first, layers.Dense(10, name="head")(x))


class KerasZoo(Runner):
    framework = "keras"

    def __init__(self, keras, member: Member, kind: str):
        super().__init__()
        self.kind = kind
        widths = member.config.get("widths") or (member.config["width"],) * member.config["depth"]
        inputs = member.batch["x"].shape[1]
        devices = jax.devices()
        if kind == "dp":
            self.label, distribution = "keras DataParallel", keras.distribution.DataParallel(devices=devices)
        else:
            self.label = "keras ModelParallel FSDP-like"
            mesh = keras.distribution.DeviceMesh((8, 1), ["batch", "model"], devices)
            layout = keras.distribution.LayoutMap(mesh)
            for variable in keras_stack(keras, inputs, widths).weights:
                dim = fsdp_dim("mlp", variable.path, tuple(variable.shape), 8)
                if dim is not None and variable.shape[dim] % 8 == 0:
                    spec = [None] * len(variable.shape)
                    spec[dim] = "batch"
                    layout[variable.path] = tuple(spec)
            distribution = keras.distribution.ModelParallel(layout_map=layout, batch_dim_name="batch")
        keras.utils.set_random_seed(0)
        with distribution.scope():
            model = keras_stack(keras, inputs, widths)
            model.compile(optimizer=keras.optimizers.AdamW(1e-3, weight_decay=1e-4),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            x, y = member.batch["x"], member.batch["y"]
            start = time.perf_counter()
            self.first_loss = float(model.train_on_batch(x, y))
            self.compile_s = time.perf_counter() - start
            self.step = jax.jit(model.train_step, donate_argnums=0,
                                out_shardings=(None, model._get_state_sharding_spec()))
            self.state = model._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                              optimizer_variables=True, metrics_variables=True)
            from keras.src.backend.jax.trainer import _distribute_data

            self.data = _distribute_data((x, y, None))
            self.collectives = collectives_of(self.step.lower(self.state, self.data).compile().as_text())
            _, self.state = self.step(self.state, self.data)
        self.notes = "Keras's jitted train_step on a placed batch"

    def run(self) -> float:
        start = time.perf_counter()
        logs, self.state = self.step(self.state, self.data)
        jax.block_until_ready((logs, self.state))
        return time.perf_counter() - start

    def state_bytes(self) -> int:
        return first_shard_bytes(self.state[:3])


def runners(member: Member, kinds) -> dict:
    """``label -> (kind, runner)`` for every installed peer that expresses a kind on ``member``."""
    found = {}
    wanted = [kind for kind in ("dp", "fsdp") if kind in kinds]
    if member.api == "nnx" and _google() is not None:
        for kind in wanted:
            runner = GoogleZoo(_google(), member, kind)
            found[runner.label] = (kind, runner)
    keras, _ = import_keras()
    if keras is not None and member.family == "mlp" and ("widths" in member.config or "depth" in member.config):
        for kind in wanted:
            runner = KerasZoo(keras, member, kind)
            found[runner.label] = (kind, runner)
    return found
