"""A script that starts JAX's processes itself (``jax.distributed.initialize``), as cluster templates do.

usage: own_init_run.py OUT_DIR [--short P:N] [--raise P:STEP | --sigkill P:STEP]

Started on every process by ``python -m parallax.launch`` or by hand (the test sets
``PARALLAX_COORDINATOR``, ``PARALLAX_NUM_PROCESSES`` and ``PARALLAX_PROCESS_ID`` either way;
the script passes them to ``jax.distributed.initialize`` itself, JAX's defaults otherwise).
A small MLP trains data-parallel over every process's devices, twice:

1. ``--short P:N``: from a generator (no ``len()``) of each process's part of every batch,
   process P's N batches shorter than the others', ``max_steps=20``; each process writes
   OUT_DIR/short<index>.json (the step it stopped at and why, its losses).
2. from arrays, ``max_steps=12``: ``--raise P:STEP`` raises in process P at that step, and
   ``--sigkill P:STEP`` SIGKILLs it, each after writing OUT_DIR/fault.json (the time);
   otherwise each process writes OUT_DIR/done<index>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import jax

jax.distributed.initialize(os.environ["PARALLAX_COORDINATOR"], int(os.environ["PARALLAX_NUM_PROCESSES"]),
                           int(os.environ["PARALLAX_PROCESS_ID"]))

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import flax.linen as nn  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import parallax as px  # noqa: E402

BATCH, ROWS = 8, 12 * 8


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(nn.relu(nn.Dense(32)(x)))


def loss_fn(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()


def at(text):
    return tuple(int(part) for part in text.split(":"))


class Fault:
    every = 1

    def __init__(self, args, index):
        self.args, self.index = args, index

    def on_step(self, info):
        for kind in ("raise_at", "sigkill"):
            given = getattr(self.args, kind)
            if given and at(given) == (self.index, info.step):
                with open(os.path.join(self.args.out, "fault.json"), "w") as stream:
                    json.dump({"time": time.time(), "kind": kind, "process": self.index, "step": info.step}, stream)
                if kind == "sigkill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError(f"planted failure in process {self.index} at step {info.step}")


def main(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--short", default=None)
    parser.add_argument("--raise", dest="raise_at", default=None)
    parser.add_argument("--sigkill", default=None)
    args = parser.parse_args(argv)
    index, count = jax.process_index(), jax.process_count()
    rng = np.random.default_rng(0)
    data = {"x": rng.normal(size=(ROWS, 16)).astype(np.float32), "y": rng.integers(0, 4, ROWS).astype(np.int32)}
    trainer = lambda **options: px.Trainer(MLP(), optax.sgd(0.1), loss_fn, strategy="dp", compile="jit",
                                           batch_size=BATCH, shuffle=False, progress=False, **options)
    if args.short:
        process, fewer = at(args.short)
        batches = ROWS // BATCH - (fewer if process == index else 0)
        part = BATCH // count

        def parts():  # a generator: no len(), as a streaming loader's
            for step in range(batches):
                rows = slice(step * BATCH + index * part, step * BATCH + (index + 1) * part)
                yield {key: value[rows] for key, value in data.items()}

        result = trainer(max_steps=20).fit(parts())
        with open(os.path.join(args.out, f"short{index}.json"), "w") as stream:
            json.dump({"stop_reason": result.stop_reason, "step": int(result.state.step),
                       "losses": [row["loss"] for row in result.history.train]}, stream)
    result = trainer(max_steps=12, callbacks=[Fault(args, index)]).fit(data)
    with open(os.path.join(args.out, f"done{index}.json"), "w") as stream:
        json.dump({"stop_reason": result.stop_reason, "step": int(result.state.step)}, stream)


if __name__ == "__main__":
    main(sys.argv[1:])
