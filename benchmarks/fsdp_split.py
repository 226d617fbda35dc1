"""Which dim FSDP splits, and how the step compiles: every combination timed side by side.

    python -m benchmarks.fsdp_split                    # 8 simulated CPU devices, MLP, LM and CNN
    python -m benchmarks.fsdp_split --models mlp --rounds 5
    python -m benchmarks.fsdp_split --smoke            # tiny models, one round: checks it still runs

For each model (``benchmarks/models.py``, AdamW, FSDP over 8 devices splitting params above
2**14 elements), ``FSDP(split=...)`` in ``"largest"`` (today's default), ``"output"`` and
``"input"``, each compiled with ``jit`` and with ``shard_map``, run interleaved in one process
in a new random order each round. Reported per configuration: the step time over the default
(``split="largest"``, ``compile="auto"``, which is ``jit`` for a loss as written) round by
round, median (min–max); per-device state bytes from the real arrays' shards; the compiled
step's temporaries; and its collective bytes by kind. Results go to
``benchmarks/results/fsdp_split.{json,md}``.
"""

from __future__ import annotations

import argparse
import os
import sys

from benchmarks import report, side_runner_args, time_interleaved

ARGS = side_runner_args(__doc__, models="mlp,lm,cnn", splits="largest,output,input") \
    if __name__ == "__main__" else None

import jax  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import parallax as px  # noqa: E402
from benchmarks.models import build, make_batch  # noqa: E402
from benchmarks.run import BATCH, MB, MIN_WEIGHT_SIZE, Config, default_path, round_ratios  # noqa: E402
from parallax.inspect import state_bytes_per_device  # noqa: E402


def bench(kind: str, splits: list[str], rounds: int, scale: float) -> list[dict]:
    model, loss_fn, _ = build(kind, scale)
    tx = optax.adamw(1e-3)
    batch = make_batch(kind, BATCH[kind], scale)
    configs = {}
    for split in splits:
        strategy = px.FSDP(min_weight_size=MIN_WEIGHT_SIZE, split=split)
        mesh = strategy.make_mesh()
        placed = px.data.to_global(batch, jax.sharding.NamedSharding(mesh, strategy.batch_spec()))
        for mode in ("jit", "shard_map"):
            state = px.init_state(model, tx, batch, strategy=strategy, loss_fn=loss_fn, mesh=mesh)
            configs[f"{split}/{mode}"] = Config(f"{split}/{mode}", px.make_train_step(loss_fn, strategy, compile=mode),
                                                state, placed)
    # What FSDP() with compile="auto" runs for the loss as written (split "largest").
    by_path = {mode: configs[f"largest/{mode}"] for mode in ("jit", "shard_map") if f"largest/{mode}" in configs}
    default_label = (f"largest/{default_path(loss_fn, px.FSDP(min_weight_size=MIN_WEIGHT_SIZE), by_path)}"
                     if by_path else next(iter(configs)))
    order = list(configs.values())
    time_interleaved(order, rounds)
    default = configs[default_label]
    return [{
        "model": kind, "config": label, "default": default_label, "ms": 1e3 * config.median_s,
        "vs_default": round_ratios(config, default),
        "state_bytes": state_bytes_per_device(config.state), "temp_bytes": config.memory["temporaries"],
        "collective_bytes": config.collective_total(),
        "collectives": {k: vars(v) for k, v in config.collectives.items() if v.count},
        "compile_s": config.compile_s,
    } for label, config in configs.items()]


def markdown(results: list[dict], meta: dict) -> str:
    lines = [f"# FSDP: which dim to split, and how to compile ({meta['devices']} {meta['platform']} devices, "
             f"jax {meta['jax']}, {meta['rounds']} rounds, AdamW)", "",
             "Ratios are step time over the default (`FSDP()` with `compile=\"auto\"` and the loss as written: "
             + ", ".join(sorted({f"{r['model']} {r['default']}" for r in results})) + "), round by round.",
             "", "| model | split / compile | ms | vs default, median (min–max) | state MB/dev | temp MB "
             "| collective MB | by kind (MB) |", "| --- | --- | ---: | --- | ---: | ---: | ---: | --- |"]
    for r in results:
        v = r["vs_default"]
        kinds = ", ".join(f"{k} {s['bytes'] / MB:.1f}" for k, s in r["collectives"].items())
        lines.append(f"| {r['model']} | {r['config']} | {r['ms']:.1f} "
                     f"| {v['median']:.2f} ({v['min']:.2f}–{v['max']:.2f}) | {r['state_bytes'] / MB:.2f} "
                     f"| {r['temp_bytes'] / MB:.1f} | {r['collective_bytes'] / MB:.1f} "
                     f"| {kinds} |")
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> None:
    results = []
    for kind in args.models.split(","):
        results.extend(bench(kind, args.splits.split(","), args.rounds, args.scale))
        print(f"{kind}: done", flush=True)
    report(args, "fsdp_split", results, markdown)


if __name__ == "__main__":
    main(ARGS)
