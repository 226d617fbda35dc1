"""What the Trainer picks on models parallax was never tuned on, against every plan measured.

    python -m benchmarks.held_out                       # 8 simulated CPU devices, three held-out models
    python -m benchmarks.held_out --models square_mlp --rounds 5
    python -m benchmarks.held_out --smoke               # tiny shapes, one round: checks it still runs

The held-out set (nothing in the search, the cost model or its calibration was ever tuned on
these; the zoo's square MLP, 784 → 2048 × 3 → 10, is not among them): a square MLP (512 → 1536 × 4
→ 100, batch 192), a transformer whose projections are
square (width 512, 8 heads, 2 blocks, 64 tokens, batch 32) and a gated (SwiGLU) MLP stack (width
1024, batch 128); AdamW. For each, on 8 devices:

- ``FSDP()`` and ``"auto"`` resolved as the Trainer resolves them for a 1,000-step run
  (:func:`parallax.state.search.resolve` with ``steps=1000``: priced, the close calls timed);
- every FSDP split on the paths it is priced on (``largest``/``output``/``input`` under ``jit``,
  ``input`` under ``shard_map``), data parallelism, and google-parallax's FSDP (every kernel's
  output dim split under ``jit``, no size threshold: ``FSDP(min_weight_size=0, split="output")``).

Each is compiled once and timed in one process, interleaved in a new random order each round.
Reported: step time over the fastest configuration, round by round, median (min–max). Results go
to ``benchmarks/results/held_out.{json,md}``.
"""

from __future__ import annotations

import os
import sys

from benchmarks import report, side_runner_args, time_interleaved

ARGS = side_runner_args(__doc__, models="square_mlp,square_transformer,gated_mlp", rounds=7) \
    if __name__ == "__main__" else None

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import parallax as px  # noqa: E402
from benchmarks.run import MB, Config, round_ratios  # noqa: E402
from parallax.state.search import SPLIT_PLANS, resolve  # noqa: E402

STEPS = 1000  # the run the Trainer resolves for


class SquareMLP(nn.Module):
    width: int = 1536
    depth: int = 4

    @nn.compact
    def __call__(self, x):
        for _ in range(self.depth):
            x = nn.gelu(nn.Dense(self.width)(x))
        return nn.Dense(100)(x)


class SquareBlock(nn.Module):
    heads: int

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        h = nn.LayerNorm()(x)
        q, k, v = (nn.Dense(d, name=n)(h).reshape(*x.shape[:2], self.heads, -1) for n in "qkv")
        a = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(x.shape)
        x = x + nn.Dense(d, name="o")(a)
        h = nn.LayerNorm()(x)
        return x + nn.Dense(d, name="down")(nn.gelu(nn.Dense(d, name="up")(h)))


class SquareTransformer(nn.Module):
    width: int = 512
    layers: int = 2
    heads: int = 8
    vocab: int = 512

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.width)(tokens)
        for _ in range(self.layers):
            x = SquareBlock(self.heads)(x)
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


class GatedMLP(nn.Module):
    width: int = 1024
    depth: int = 2

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(self.width)(x)
        for _ in range(self.depth):
            h = nn.RMSNorm()(x)
            x = x + nn.Dense(self.width)(nn.silu(nn.Dense(self.width)(h)) * nn.Dense(self.width)(h))
        return nn.Dense(10)(x)


def classify(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()


def next_token(model, batch):
    logits = model(batch["x"][:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["x"][:, 1:]).mean()


def build(kind: str, scale: float):
    """The model, its loss and one batch (``scale`` shrinks widths and batch for ``--smoke``)."""
    rng = np.random.default_rng(0)
    shrink = lambda n: max(8, int(n * scale))
    if kind == "square_mlp":
        rows = shrink(192) // 8 * 8
        return (SquareMLP(width=shrink(1536)), classify,
                {"x": rng.normal(size=(rows, 512)).astype(np.float32),
                 "y": rng.integers(0, 100, rows).astype(np.int32)})
    if kind == "square_transformer":
        rows = max(8, shrink(32) // 8 * 8)
        return (SquareTransformer(width=shrink(512)), next_token,
                {"x": rng.integers(0, 512, (rows, 65)).astype(np.int32)})
    if kind == "gated_mlp":
        rows = shrink(128) // 8 * 8
        return (GatedMLP(width=shrink(1024)), classify,
                {"x": rng.normal(size=(rows, 256)).astype(np.float32), "y": rng.integers(0, 10, rows).astype(np.int32)})
    raise ValueError(f"unknown model {kind!r}")


def configs(kind: str, scale: float) -> tuple[dict, dict]:
    model, loss_fn, batch = build(kind, scale)
    tx = optax.adamw(1e-3)
    chosen, out = {}, {}

    def add(label, strategy, mesh, step):
        state = px.init_state(model, tx, batch, strategy=strategy, loss_fn=loss_fn, mesh=mesh)
        placed = px.data.to_global(batch, jax.sharding.NamedSharding(mesh, strategy.batch_spec()))
        out[label] = Config(label, step, state, placed)

    for name, asked in (("FSDP() as the Trainer resolves it", px.FSDP()),
                        ('"auto" as the Trainer resolves it', "auto")):
        found = resolve(model, tx, batch, asked, loss_fn=loss_fn, steps=STEPS)
        chosen[name] = found.describe()
        add(name, found.strategy, found.mesh, found.train_step(loss_fn, px.StepOptions()))
    plans = {f"FSDP split={split}, {path}": (px.FSDP(split=split), path) for split, path in SPLIT_PLANS}
    plans["google-parallax FSDP (output dims, jit, every kernel)"] = (px.FSDP(min_weight_size=0, split="output"), "jit")
    plans["DataParallel"] = (px.DataParallel(), "jit")
    for label, (strategy, path) in plans.items():
        add(label, strategy, strategy.make_mesh(), px.make_train_step(loss_fn, strategy, compile=path))
    return out, chosen


def bench(kind: str, rounds: int, scale: float) -> list[dict]:
    runs, chosen = configs(kind, scale)
    time_interleaved(list(runs.values()), rounds)
    fastest = min(runs.values(), key=lambda c: c.median_s)
    rows = []
    for label, config in runs.items():
        rows.append({"model": kind, "config": label, "ms": 1e3 * config.median_s,
                     "vs_fastest": round_ratios(config, fastest),
                     "chosen": chosen.get(label, ""), "temp_bytes": config.memory["temporaries"],
                     "collective_bytes": config.collective_total(), "compile_s": config.compile_s})
    return rows


def markdown(results: list[dict], meta: dict) -> str:
    lines = [f"# The Trainer's pick on held-out models ({meta['devices']} {meta['platform']} devices, "
             f"jax {meta['jax']}, {meta['rounds']} rounds, AdamW)", "",
             "Step time over the fastest configuration of the same model, round by round: median (min–max).", "",
             "| model | configuration | ms | vs fastest | temp MB | collective MB |",
             "| --- | --- | ---: | --- | ---: | ---: |"]
    for r in results:
        v = r["vs_fastest"]
        lines.append(f"| {r['model']} | {r['config']} | {r['ms']:.1f} "
                     f"| {v['median']:.2f} ({v['min']:.2f}–{v['max']:.2f}) "
                     f"| {r['temp_bytes'] / MB:.1f} | {r['collective_bytes'] / MB:.1f} |")
    lines += ["", "What the searches chose:", ""]
    lines += [f"- {r['model']}, {r['config']}: {r['chosen']}" for r in results if r["chosen"]]
    return "\n".join(lines) + "\n"


def main(args) -> None:
    results = [row for kind in args.models.split(",") for row in bench(kind, args.rounds, args.scale)]
    report(args, "held_out", results, markdown)


if __name__ == "__main__":
    main(ARGS)
