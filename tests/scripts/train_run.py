"""A training run in its own process, for the preemption and resume tests.

usage: train_run.py CKPT_DIR OUT.npz MAX_STEPS [--resume] [--sigkill-at N] [--sigterm-at N] [--sigint-at N]
                    [--sigint-twice-at N] [--every N] [--return] [--strategy fsdp|dp] [--devices N]

A signal "at N" is sent while step N's metrics are read (after step N+1 was dispatched).
"""

import os
import sys

# the suite's flags kept
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import logging
import signal

import jax
import numpy as np
import optax

import parallax as px
from tests.models import TinyLM, lm_loss
from tests.reference import wait_for_newest_save


class Interrupt:
    every = 1

    def __init__(self, at, signum, times=1):
        self.at, self.signum, self.times = at, signum, times

    def on_step(self, info):
        if info.step == self.at:
            if self.signum == signal.SIGKILL:  # as soon as its checksum record must be there
                wait_for_newest_save(info.trainer.checkpointer, self.at)
            else:
                info.trainer.checkpointer.wait()
            for _ in range(self.times):
                os.kill(os.getpid(), self.signum)


def main(argv):
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", force=True)
    ckpt, out, max_steps = argv[0], argv[1], int(argv[2])
    callbacks = []
    for flag, signum, times in (("--sigkill-at", signal.SIGKILL, 1), ("--sigterm-at", signal.SIGTERM, 1),
                                ("--sigint-at", signal.SIGINT, 1), ("--sigint-twice-at", signal.SIGINT, 2)):
        if flag in argv:
            callbacks.append(Interrupt(int(argv[argv.index(flag) + 1]), signum, times))
    every = int(argv[argv.index("--every") + 1]) if "--every" in argv else 3
    tokens = np.random.default_rng(0).integers(0, 64, (80, 9)).astype(np.int32)
    strategy = px.DataParallel() if "--strategy" in argv and argv[argv.index("--strategy") + 1] == "dp" \
        else px.FSDP(min_weight_size=256)
    devices = jax.devices()[: int(argv[argv.index("--devices") + 1])] if "--devices" in argv else None
    trainer = px.Trainer(TinyLM(dropout_rate=0.1), optax.adamw(3e-3), lm_loss, strategy=strategy, devices=devices,
                         max_steps=max_steps, batch_size=16, checkpoint_dir=ckpt, checkpoint_every=every,
                         callbacks=callbacks, progress=False, on_preemption="return" if "--return" in argv else "exit")
    state = trainer.fit({"x": tokens}, resume="--resume" in argv).state
    flat = jax.tree_util.tree_flatten_with_path((state.params, state.opt_state))[0]
    np.savez(out, **{jax.tree_util.keystr(k): np.asarray(v) for k, v in flat})


if __name__ == "__main__":
    main(sys.argv[1:])
