"""One training run of the several-processes tests, started by ``python -m parallax.launch``.

usage: multiprocess_run.py OUT_DIR [--strategy fsdp|dp+fsdp] [--steps N] [--every N] [--resume]
           [--signal P:STEP]... [--raise P:STEP] [--sigkill P:STEP] [--slow SECONDS]
           [--warm-cache P] [--eval-rows N] [--iterable-eval] [--short-rows P] [--progress]
           [--offload optimizer|optimizer+params]

A small transformer LM (tests.models.TinyLM, AdamW) on 96 sequences, global batch 16, eval
on ``--eval-rows`` sequences (odd by default) every 2 steps, checkpoints in OUT_DIR/ckpt
every ``--every`` steps. Each process writes OUT_DIR/result<index>.json: the step it
stopped at and why, the compile path it chose, its history (process 0's also in
OUT_DIR/log.jsonl as it goes, through px.JSONLogger). ``--iterable-eval`` gives the eval set
as a list of each process's parts of every batch, split unevenly where a batch does not
divide (the last one: 3 rows and 2). ``--short-rows P`` gives process P sequences one token
shorter than the others'. ``--offload`` keeps that state in host memory (each process writes
OUT_DIR/memory<index>.json: the optimizer state's memory kinds after its first step).

Faults, at a step as its metrics are read (the step after it is already dispatched):
``--signal P:STEP`` sends SIGTERM to process P (when P stopped before STEP, as training
ends: a late signal, as schedulers send them); ``--raise P:STEP`` raises in process P
(writing OUT_DIR/raised.json with the time first); ``--sigkill P:STEP`` waits until the
newest due checkpoint is committed, then SIGKILLs process P. ``--slow`` sleeps that long
per step on every process (a step time long enough for JAX's preemption notifier, which
looks for signals once a second). ``--warm-cache P`` gives process P a cache of device
speeds (made up, far from what process 0 measures) while the others start cold.

The tests import :func:`run` to train the same run in one process on 8 devices.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np
import optax

import parallax as px
from tests.models import TinyLM, lm_loss
from tests.reference import wait_for_newest_save

BATCH = 16


def parse(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--strategy", default="fsdp")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--signal", action="append", default=[])
    parser.add_argument("--raise", dest="raise_at", default=None)
    parser.add_argument("--sigkill", default=None)
    parser.add_argument("--slow", type=float, default=0.0)
    parser.add_argument("--warm-cache", type=int, default=None)
    parser.add_argument("--eval-rows", type=int, default=37)
    parser.add_argument("--iterable-eval", action="store_true")
    parser.add_argument("--short-rows", type=int, default=None)
    parser.add_argument("--progress", action="store_true")
    parser.add_argument("--offload", default=None)
    return parser.parse_args(argv)


def at(text):
    process, step = (int(part) for part in text.split(":"))
    return process, step


def data(args, index, count):
    tokens = np.random.default_rng(0).integers(0, 64, (96, 9)).astype(np.int32)
    held_out = np.random.default_rng(1).integers(0, 64, (args.eval_rows, 9)).astype(np.int32)
    if args.short_rows == index:
        tokens = tokens[:, :-1]
    if not args.iterable_eval:
        return {"x": tokens}, {"x": held_out}
    parts = []
    for start in range(0, len(held_out), BATCH):
        rows = held_out[start:start + BATCH]
        bounds = np.linspace(0, len(rows), count + 1).astype(int)  # 16 rows: 8 and 8; 5 rows: 2 and 3
        parts.append({"x": rows[bounds[index]:bounds[index + 1]]})
    return {"x": tokens}, parts


def strategy(name):
    if name == "fsdp":
        return px.FSDP(min_weight_size=256)
    return px.combine(px.DataParallel(2), px.FSDP(4, min_weight_size=256))


class Faults:
    """Injects the faults the arguments name, in the process they name."""

    every = 1

    def __init__(self, args, index):
        self.args, self.index = args, index
        self.signals = {step for process, step in map(at, args.signal) if process == index}
        self.sent: list = []  # the steps at which this process's signals went out ("end": as fit ended)

    def on_step(self, info):
        args, step = self.args, info.step
        if args.slow:
            time.sleep(args.slow)
        if step in self.signals:
            self.sent.append(step)
            os.kill(os.getpid(), signal.SIGTERM)
        if args.raise_at and at(args.raise_at) == (self.index, step):
            with open(os.path.join(args.out, "raised.json"), "w") as stream:
                json.dump({"time": time.time(), "process": self.index, "step": step}, stream)
            raise RuntimeError(f"injected failure in process {self.index} at step {step}")
        if args.offload and step == info.trainer.start_step + 1:  # where the offloaded state lives between steps
            import jax

            kinds = sorted({x.sharding.memory_kind for x in jax.tree.leaves(info.trainer.state.opt_state)})
            with open(os.path.join(args.out, f"memory{self.index}.json"), "w") as stream:
                json.dump(kinds, stream)
        if args.sigkill and at(args.sigkill) == (self.index, step):
            wait_for_newest_save(info.trainer.checkpointer, step)
            os.kill(os.getpid(), signal.SIGKILL)

    def on_fit_end(self, trainer):
        for _ in sorted(self.signals - set(self.sent)):
            self.sent.append("end")
            os.kill(os.getpid(), signal.SIGTERM)


def warm_cache(index, args):
    """A cache directory per process; process ``--warm-cache`` gets made-up device speeds."""
    import jax

    from parallax.pricing import cost

    folder = os.path.join(args.out, f"cache{index}")
    os.environ["PARALLAX_CACHE_DIR"] = folder
    if args.warm_cache == index:
        key = cost.device_key(jax.devices())
        made_up = {"seconds_per_flop": 1e-6, "seconds_per_byte": 1e-12, "seconds_per_layout_byte": 1e-12,
                   "overhead": 1e-6, "collectives": {kind: [1.0, 1e-3] for kind in cost.KINDS},
                   "calibration_seconds": 0.0}
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, cost.CACHE_FILE), "w") as stream:
            json.dump({key: made_up}, stream)


def run(args, index=0, count=1):
    """Trains as the arguments say; returns (and writes) this process's record."""
    train, held_out = data(args, index, count)
    callbacks = [Faults(args, index), px.JSONLogger(os.path.join(args.out, "log.jsonl"))]
    trainer = px.Trainer(TinyLM(), optax.adamw(3e-3), lm_loss, strategy=strategy(args.strategy), max_steps=args.steps,
                         batch_size=BATCH, eval_batch_size=BATCH, eval_every=2,
                         checkpoint_dir=os.path.join(args.out, "ckpt"), checkpoint_every=args.every,
                         callbacks=callbacks, progress=args.progress, on_preemption="return", shuffle=False,
                         offload=args.offload)
    result = trainer.fit(train, eval_data=held_out, resume=args.resume)
    searched = trainer.search.choice if trainer.search is not None else None  # FSDP's split, priced
    choice = trainer.train_step.choice or searched
    record = {"process": index, "stop_reason": result.stop_reason, "step": int(result.state.step),
              "start": trainer.start_step, "compile": choice.picked if choice is not None else None,
              "train": result.history.train, "eval": result.history.eval,
              "checkpoints": trainer.checkpointer.steps(), "signals": callbacks[0].sent}
    with open(os.path.join(args.out, f"result{index}.json"), "w") as stream:
        json.dump(record, stream)
    return record


if __name__ == "__main__":
    options = parse(sys.argv[1:])
    processes = px.distributed.initialize()
    warm_cache(processes.index, options)
    run(options, processes.index, processes.count)
