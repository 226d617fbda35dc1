"""One training run on a Grain pipeline, for ``tests/test_grain.py`` (alone, or under ``python -m parallax.launch``).

usage: grain_run.py OUT_DIR [--form iter|map] [--steps N] [--workers N] [--resume] [--sigkill-at STEP]
           [--devices N]

An MLP (tests.models.MLP, Adam, FSDP with its split pinned, ``compile="jit"``) on 256 random examples read from a
random-access source that appends each index it reads to OUT_DIR/reads-<pid>.txt (worker
processes included). ``--form iter``: Grain shuffles and batches (``MapDataset.shuffle(7)
.batch(16).to_iter_dataset()``, with ``--workers`` processes through ``mp_prefetch``), its
iterator's state saved in each checkpoint; ``--form map``: the ``MapDataset`` of examples with
``batch_size=16``, shuffled and split by parallax. A checkpoint every step in OUT_DIR/ckpt.
``--sigkill-at STEP`` SIGKILLs this process as step STEP's metrics are read. Each process
writes OUT_DIR/result<index>.json (losses by step); a single process also OUT_DIR/params.npz.

The test imports :func:`run` to train the same run in its own process.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import grain
import jax
import numpy as np
import optax

import parallax as px
from tests.models import MLP, classifier_loss

EXAMPLES, BATCH = 256, 16


class CountingSource:
    """Random access to the examples; every read appends its index to ``log_dir/reads-<pid>.txt``."""

    def __init__(self, log_dir: str):
        rng = np.random.default_rng(0)
        self.x = rng.normal(size=(EXAMPLES, 24)).astype(np.float32)
        self.y = rng.integers(0, 10, EXAMPLES).astype(np.int32)
        self.log_dir = log_dir

    def __len__(self) -> int:
        return EXAMPLES

    def __getitem__(self, index):
        with open(os.path.join(self.log_dir, f"reads-{os.getpid()}.txt"), "a") as log:
            log.write(f"{int(index)}\n")
        return {"x": self.x[index], "y": self.y[index]}


def data(form: str, log_dir: str, workers: int = 0):
    source = grain.MapDataset.source(CountingSource(log_dir))
    if form == "map":
        return source
    pipeline = source.shuffle(seed=7).batch(BATCH, drop_remainder=True).to_iter_dataset()
    return pipeline.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers)) if workers else pipeline


def order(form: str) -> list[list[int]]:
    """The examples of each global batch of the first epoch, in order (for the read counts)."""
    if form == "map":
        return [list(np.random.default_rng([0, 0]).permutation(EXAMPLES)[b * BATCH:(b + 1) * BATCH])
                for b in range(EXAMPLES // BATCH)]
    shuffled = grain.MapDataset.range(EXAMPLES).shuffle(seed=7).batch(BATCH, drop_remainder=True)
    return [list(map(int, shuffled[b])) for b in range(len(shuffled))]


class KillAt:
    """SIGKILLs this process as step ``step``'s metrics are read."""

    def __init__(self, step: int):
        self.step = step

    def on_step(self, info) -> None:
        if info.step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def trainer(out: str, steps: int, callbacks=(), devices=None) -> px.Trainer:
    # The split pinned: split="auto" times its candidates only for runs long enough to repay it, so a run of
    # 5 steps and one of 10 could pick two layouts (one float32 ulp apart) once a machine's timings are cached.
    return px.Trainer(MLP(), optax.adam(1e-2), classifier_loss, strategy=px.FSDP(min_weight_size=0, split="largest"),
                      max_steps=steps, batch_size=BATCH, seed=0, compile="jit",
                      checkpoint_dir=os.path.join(out, "ckpt"), checkpoint_every=1, async_checkpoints=False,
                      progress=False, callbacks=callbacks,
                      devices=None if devices is None else jax.devices()[:devices])


def run(args) -> px.train.config.FitResult:
    callbacks = [KillAt(args.sigkill_at)] if args.sigkill_at is not None else []
    result = trainer(args.out, args.steps, callbacks, args.devices).fit(data(args.form, args.out, args.workers),
                                                                        resume=args.resume)
    losses = {row["step"]: row["loss"] for row in result.history.train}
    with open(os.path.join(args.out, f"result{jax.process_index()}.json"), "w") as stream:
        json.dump({"losses": losses, "stop_reason": result.stop_reason}, stream)
    if jax.process_count() == 1:  # (the params of several processes are not all addressable here)
        params = jax.tree_util.tree_flatten_with_path(jax.device_get(result.state.params))[0]
        np.savez(os.path.join(args.out, "params.npz"), **{jax.tree_util.keystr(p): v for p, v in params})
    return result


def parse(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--form", default="iter", choices=("iter", "map"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--sigkill-at", type=int, default=None)
    parser.add_argument("--devices", type=int, default=None, help="train on this process's first N devices")
    return parser.parse_args(argv)


if __name__ == "__main__":
    jax.config.update("jax_threefry_partitionable", True)
    if os.environ.get("PARALLAX_NUM_PROCESSES"):
        px.distributed.initialize()
    run(parse(sys.argv[1:]))
