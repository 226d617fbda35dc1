"""The per-step cost of agreeing on preemption across processes, on the benchmark models.

    python -m benchmarks.preemption_agreement [--steps 30] [--scale 1.0]

Starts itself as 2 processes x 4 simulated CPU devices (``python -m parallax.launch``). In
each process, each benchmark model (MLP, transformer LM, CNN; FSDP over all 8 devices,
Adam, global batch 64) runs its compiled train step, and after every step the check the
Trainer makes (JAX's ``reached_preemption_sync_point``), both timed, interleaved step by
step. Process 0 prints per model the step time, the check's time (min/median/max) and their
ratio. Nothing is signalled: this is the cost paid on every step of every run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def _measure(steps: int, scale: float) -> None:
    import optax
    from jax.experimental import multihost_utils

    import parallax as px
    from benchmarks.models import build, make_batch

    px.distributed.initialize()
    import jax

    rows = []
    for kind in ("mlp", "lm", "cnn"):
        model, loss_fn, _ = build(kind, scale)
        batch = make_batch(kind, 64, scale)
        share = 64 // jax.process_count()
        local = jax.tree.map(lambda a, share=share: a[jax.process_index() * share:(jax.process_index() + 1) * share],
                             batch)
        trainer = px.Trainer(model, optax.adam(1e-3), loss_fn, strategy=px.FSDP(min_weight_size=2**14),
                             progress=False, batch_size=64)
        state = trainer.init(local)
        placed = px.data.to_global(local, trainer.batch_sharding)
        step_times, check_times = [], []
        for step in range(1, steps + 3):
            start = time.perf_counter()
            state, metrics = trainer.train_step(state, placed)
            jax.block_until_ready(metrics)
            middle = time.perf_counter()
            multihost_utils.reached_preemption_sync_point(step)
            end = time.perf_counter()
            if step > 2:  # compile and warm-up
                step_times.append(middle - start)
                check_times.append(end - middle)
        ratios = [c / s for c, s in zip(check_times, step_times)]
        rows.append((kind, statistics.median(step_times), check_times, ratios))
    if jax.process_index() == 0:
        print(f"{'model':6} {'step ms (median)':>17} {'check us min/median/max':>26} {'check/step median (max)':>26}")
        for kind, step_s, checks, ratios in rows:
            spread = "/".join(f"{1e6 * f(checks):.1f}" for f in (min, statistics.median, max))
            print(f"{kind:6} {1e3 * step_s:17.1f} {spread:>26} "
                  f"{100 * statistics.median(ratios):18.4f}% ({100 * max(ratios):.4f}%)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--scale", type=float, default=1.0)
    options = parser.parse_args()
    if "PARALLAX_PROCESS_ID" in os.environ:
        _measure(options.steps, options.scale)
        return 0
    command = [sys.executable, "-m", "parallax.launch", "--processes", "2", "--devices-per-process", "4",
               "--timeout", "1200", "-m", "benchmarks.preemption_agreement", "--steps", str(options.steps),
               "--scale", str(options.scale)]
    return subprocess.call(command, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


if __name__ == "__main__":
    sys.exit(main())
