"""One network written in linen and in NNX, trained by parallax: step time and memory side by side.

    python -m benchmarks.nnx_vs_linen                     # 8 simulated CPU devices, MLP and LM
    python -m benchmarks.nnx_vs_linen --models mlp --rounds 5
    python -m benchmarks.nnx_vs_linen --smoke             # tiny models, one round: checks it still runs

For each model (``benchmarks/models.py`` in linen, ``benchmarks/nnx_models.py`` the same
network in NNX, started from the same weights) and strategy, three steps run interleaved in one
process, in a new random order each round:

- ``linen``: ``px.make_train_step`` on the linen module;
- ``nnx``: ``px.make_train_step`` on the NNX module (parallax's mechanism: the module's values
  as plain state, merged inside the compiled step);
- ``nnx.jit``: the alternative mechanism, what an NNX user writes: ``nnx.jit`` over the module
  and an ``nnx.Optimizer``, with the state placed as parallax plans it.

Reported: step time ratios over linen round by round (median, min–max), the first loss of each
(the same network from the same weights: equal up to float rounding), per-device state bytes
from the real arrays' shards (for ``nnx.jit``: after its steps, as the compiler left them), and
the compiled step's temporaries and collective bytes (parallax's two). Results go to
``benchmarks/results/nnx_vs_linen.{json,md}``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from benchmarks import report, side_runner_args, time_interleaved

ARGS = side_runner_args(__doc__, models="mlp,lm", strategies="dp,fsdp,fsdp+tp") \
    if __name__ == "__main__" else None

import re  # noqa: E402

import flax  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import parallax as px  # noqa: E402
from benchmarks import models as linen_models  # noqa: E402
from benchmarks import nnx_models  # noqa: E402
from benchmarks.run import BATCH, MB, Config, make_strategy, round_ratios  # noqa: E402
from parallax.inspect import state_bytes_per_device  # noqa: E402


class NNXJit:
    """``nnx.jit`` over the module and an ``nnx.Optimizer``: the step an NNX user writes by hand."""

    def __init__(self, label: str, build, loss_fn, tx, plan: px.StatePlan, params, batch):
        self.label, self.batch, self.times = label, batch, []
        self.model = build()
        placed = jax.device_put(params, plan.shardings.params)
        nnx.update(self.model, placed)
        self.optimizer = nnx.Optimizer(self.model, tx, wrt=nnx.Param)

        self.step = step = nnx_models.train_step(loss_fn)
        start = time.perf_counter()
        self.first_loss = float(step(self.model, self.optimizer, batch))
        self.compile_s = time.perf_counter() - start

    def run(self) -> float:
        start = time.perf_counter()
        loss = self.step(self.model, self.optimizer, self.batch)
        jax.block_until_ready((loss, nnx.state(self.model)))
        return time.perf_counter() - start

    def state_bytes(self) -> int:
        arrays = (nnx.state(self.model), nnx.state(self.optimizer))
        return sum(shard.data.nbytes for leaf in jax.tree.leaves(arrays) if isinstance(leaf, jax.Array)
                   for shard in leaf.addressable_shards[:1])


def bench(kind: str, names: list[str], rounds: int, scale: float) -> list[dict]:
    linen_model, linen_loss, rules = linen_models.build(kind, scale)
    build, nnx_loss = nnx_models.build(kind, scale)
    tx = optax.adam(1e-3)
    batch = linen_models.make_batch(kind, BATCH[kind], scale)
    rows = []
    for name in names:
        strategy = make_strategy(name, rules)
        mesh = strategy.make_mesh()
        placed = px.data.to_global(batch, jax.sharding.NamedSharding(mesh, strategy.batch_spec()))
        nnx_plan = px.plan_state(build, tx, batch, strategy=strategy, loss_fn=nnx_loss, mesh=mesh)
        nnx_state = nnx_plan.build()
        weights = jax.device_get(nnx_state.params)
        linen_state = px.init_state(linen_model, tx, batch, strategy=strategy, loss_fn=linen_loss, mesh=mesh)
        linen_state = linen_state.replace(params=jax.device_put(to_linen(weights, linen_state.params),
                                                                jax.tree.map(lambda x: x.sharding, linen_state.params)))
        configs = {
            "linen": Config(f"{kind}/{name}/linen", px.make_train_step(linen_loss, strategy), linen_state, placed),
            "nnx": Config(f"{kind}/{name}/nnx", px.make_train_step(nnx_loss, strategy), nnx_state, placed),
        }
        first = {}
        for label, config in configs.items():  # the first step from the same weights (Adam's state is zeros)
            config.state, metrics = config.compiled(config.state, config.batch)
            first[label] = float(metrics["loss"])
        handwritten = NNXJit(f"{kind}/{name}/nnx.jit", build, nnx_loss, tx, nnx_plan, weights, placed)
        first["nnx.jit"] = handwritten.first_loss
        rows.append((name, configs, handwritten, first))
    runners = [r for _, configs, handwritten, _ in rows for r in (*configs.values(), handwritten)]
    time_interleaved(runners, rounds)
    results = []
    for name, configs, handwritten, first in rows:
        linen, ours = configs["linen"], configs["nnx"]
        results.append({
            "model": kind, "strategy": name,
            "ms": {"linen": 1e3 * linen.median_s, "nnx": 1e3 * ours.median_s,
                   "nnx.jit": 1e3 * float(np.median(handwritten.times))},
            "nnx_vs_linen": round_ratios(ours, linen),
            "nnx_jit_vs_linen": round_ratios(handwritten, linen),
            "first_loss": first,
            "state_bytes": {"linen": state_bytes_per_device(linen.state), "nnx": state_bytes_per_device(ours.state),
                            "nnx.jit": handwritten.state_bytes()},
            "temp_bytes": {"linen": linen.memory["temporaries"], "nnx": ours.memory["temporaries"]},
            "collective_bytes": {"linen": linen.collective_total(), "nnx": ours.collective_total()},
        })
    return results


LINEN_NAMES = ((r"^blocks/(\d+)/norm_(\d)/", r"block_\1/LayerNorm_\2/"), (r"^blocks/(\d+)/", r"block_\1/"),
               (r"^norm/", "LayerNorm_0/"))


def to_linen(nnx_params: dict, linen_params) -> dict:
    """NNX weights in the linen model's tree: the same network, only some layer names differ."""
    flat = {}
    for keys, value in flax.traverse_util.flatten_dict(nnx_params).items():
        path = "/".join(map(str, keys))
        for pattern, replacement in LINEN_NAMES:
            path = re.sub(pattern, replacement, path)
        flat[path] = value
    wanted = flax.traverse_util.flatten_dict(linen_params, sep="/")
    if set(flat) != set(wanted) or any(np.shape(flat[k]) != np.shape(v) for k, v in wanted.items()):
        raise ValueError(f"the linen and NNX benchmark models differ: {sorted(set(flat) ^ set(wanted))[:6]}")
    return flax.traverse_util.unflatten_dict(flat, sep="/")


def markdown(results: list[dict], meta: dict) -> str:
    lines = [f"# One network in linen and in NNX ({meta['devices']} {meta['platform']} devices, jax {meta['jax']}, "
             f"flax {meta['flax']}, {meta['rounds']} rounds)", "",
             "| model | strategy | linen ms | nnx ms | nnx / linen, median (min–max) | nnx.jit ms "
             "| nnx.jit / linen | state MB/dev linen / nnx / nnx.jit | temp MB linen / nnx "
             "| collective MB linen / nnx | first loss linen / nnx / nnx.jit |",
             "| --- | --- | ---: | ---: | --- | ---: | --- | --- | --- | --- | --- |"]
    for r in results:
        a, b = r["nnx_vs_linen"], r["nnx_jit_vs_linen"]
        s, t, c, f = r["state_bytes"], r["temp_bytes"], r["collective_bytes"], r["first_loss"]
        lines.append(
            f"| {r['model']} | {r['strategy']} | {r['ms']['linen']:.1f} | {r['ms']['nnx']:.1f} "
            f"| {a['median']:.2f} ({a['min']:.2f}–{a['max']:.2f}) | {r['ms']['nnx.jit']:.1f} "
            f"| {b['median']:.2f} ({b['min']:.2f}–{b['max']:.2f}) "
            f"| {s['linen'] / MB:.2f} / {s['nnx'] / MB:.2f} / {s['nnx.jit'] / MB:.2f} "
            f"| {t['linen'] / MB:.2f} / {t['nnx'] / MB:.2f} | {c['linen'] / MB:.2f} / {c['nnx'] / MB:.2f} "
            f"| {f['linen']:.5f} / {f['nnx']:.5f} / {f['nnx.jit']:.5f} |")
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> None:
    results = []
    for kind in args.models.split(","):
        results.extend(bench(kind, args.strategies.split(","), args.rounds, args.scale))
        print(f"{kind}: done", flush=True)
    report(args, "nnx_vs_linen", results, markdown, flax=flax.__version__)


if __name__ == "__main__":
    main(ARGS)
