"""A mixture of experts on one real accelerator: parallax's step (with and without the experts'
run change) against a plain optax loop, and ``px.plan``'s peak against the device's own count
(``python -m benchmarks.gpu_moe``).

Expert parallelism needs several devices; what one chip can answer is whether the way
:class:`parallax.ExpertParallel` runs a model costs anything there. The model is a Switch-style
transformer LM (top-1 routing, a capacity of 1.25 per row of tokens, a one-hot dispatch to
``[experts, width, hidden]`` weights, a load-balancing loss) in bf16 with float32 master params and
AdamW. Three steps train it from the same params, timed in interleaved rounds in one process:

- **plain**: a ``jax.jit`` optax step, what a user writes without parallax;
- **parallax**: the Trainer's step with its default strategy;
- **parallax EP**: the Trainer's step under ``ExpertParallel(1)``, so the traced loss is
  re-evaluated with every matmul over the experts pinned along the experts dim
  (:mod:`parallax.parallel.experts.dispatch`): on one device the pins place nothing, and any
  difference in time is what re-binding the model's equations costs the compiler.

MFU counts the useful FLOPs: each token through its one expert (not the capacity's empty
slots), attention, the router and the head, forward and backward (3 × forward). The memory part
runs ``ExpertParallel(1)`` in a fresh process and compares the allocator's peak after real steps
with ``px.plan``'s, planned on the GPU and on CPU with ``target="gpu"``.

``--small`` runs tiny shapes on whatever backend is present (a check of this script).
"""

import argparse
import json
import os
import subprocess
import sys
import time

from benchmarks.gpu import PEAK_FLOPS, fit_against_loop, flops_of, plain_step, run_parts

EXPERTS = 8


def build(small: bool):
    """The model, its loss, an example batch (numpy), the data for ``fit`` and the shape."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    dim, heads, layers, hidden, vocab, batch, length = ((64, 4, 2, 128, 512, 4, 64) if small
                                                        else (1024, 16, 4, 4096, 32_000, 16, 1024))

    class SwitchFFN(nn.Module):
        @nn.compact
        def __call__(self, h):
            probs = jax.nn.softmax(nn.Dense(EXPERTS, use_bias=False, name="router")(h).astype(jnp.float32))
            capacity = int(1.25 * h.shape[1] / EXPERTS)
            chosen = jax.nn.one_hot(jnp.argmax(probs, -1), EXPERTS)
            slot = (jnp.cumsum(chosen, axis=1) - 1) * chosen
            combine = (probs * chosen * (slot < capacity))[..., None] * jax.nn.one_hot(slot, capacity)
            init = nn.initializers.lecun_normal(batch_axis=(0,))
            w_in = self.param("w_in", init, (EXPERTS, dim, hidden)).astype(h.dtype)
            w_out = self.param("w_out", init, (EXPERTS, hidden, dim)).astype(h.dtype)
            dispatched = jnp.einsum("gtec,gtd->egcd", (combine > 0).astype(h.dtype), h)
            out = jnp.einsum("egch,ehd->egcd", nn.gelu(jnp.einsum("egcd,edh->egch", dispatched, w_in)), w_out)
            balance = EXPERTS * jnp.sum(chosen.mean((0, 1)) * probs.mean((0, 1)))
            return jnp.einsum("egcd,gtec->gtd", out, combine.astype(h.dtype)), balance

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.LayerNorm()(x)
            x = x + nn.MultiHeadDotProductAttention(heads, name="attn")(h, h, mask=nn.make_causal_mask(x[..., 0]))
            out, balance = SwitchFFN(name="moe")(nn.LayerNorm()(x))
            return x + out, balance

    class Transformer(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(vocab, dim, name="embed")(tokens)
            balance = 0.0
            for i in range(layers):
                x, b = Block(name=f"block_{i}")(x)
                balance = balance + b
            return nn.Dense(vocab, name="head")(nn.LayerNorm()(x)), balance / layers

    def loss_fn(model, batch):
        logits, balance = model(batch["tokens"][:, :-1])
        labels = batch["tokens"][:, 1:]
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype("float32"), labels).mean() + 0.01 * balance

    rng = np.random.default_rng(0)
    data = {"tokens": rng.integers(0, vocab, (batch * 40, length + 1), dtype=np.int32)}
    example = {"tokens": data["tokens"][:batch]}
    shape = {"dim": dim, "heads": heads, "layers": layers, "experts": EXPERTS, "hidden": hidden, "vocab": vocab,
             "batch": batch, "tokens": length}
    return Transformer(), loss_fn, example, data, shape


def model_flops(shape: dict) -> float:
    """Useful FLOPs of one training step: each token through attention's projections, its one
    expert, the router and the head (6 × params × tokens), plus q·kᵀ and weights·v."""
    d, layers, tokens = shape["dim"], shape["layers"], shape["batch"] * shape["tokens"]
    per_token = layers * (4 * d * d + 2 * d * shape["hidden"] + d * shape["experts"]) + d * shape["vocab"]
    return 6 * per_token * tokens + 12 * layers * shape["batch"] * shape["tokens"] ** 2 * d


def strategies():
    import parallax as px

    return {"parallax": None, "parallax EP": px.ExpertParallel(1)}


def speed(args) -> dict:
    """Step times of the plain step and parallax's two, interleaved rounds, bf16."""
    import jax
    import numpy as np
    import optax

    import parallax as px

    model, loss_fn, example, data, shape = build(args.small)
    kind = jax.devices()[0].device_kind
    peak = next((v["bf16"] for k, v in PEAK_FLOPS.items() if k in kind), None)
    tx = optax.adamw(3e-4)
    trainers = {name: px.Trainer(model, tx, loss_fn, batch_size=shape["batch"], max_steps=args.steps, shuffle=False,
                                 progress=False, precision="bf16", **({"strategy": s} if s else {}))
                for name, s in strategies().items()}
    states = {name: trainer.init(example) for name, trainer in trainers.items()}
    batches = {name: jax.device_put(example, trainer.batch_sharding) for name, trainer in trainers.items()}
    params = jax.tree.map(np.asarray, states["parallax"].params)  # both trainers init from the same seed
    plain = plain_step(model, loss_fn, tx, "bf16")
    p, o = jax.device_put(params), tx.init(jax.device_put(params))
    device_batch = jax.device_put(example)
    xla_flops = flops_of(plain.lower(p, o, device_batch).compile())
    p, o, first = plain(p, o, device_batch)
    first_losses = {"plain": float(first)}
    for name, trainer in trainers.items():
        states[name], metrics = trainer.train_step(states[name], batches[name])
        first_losses[name] = float(metrics["loss"])
    times = {name: [] for name in ("plain", *trainers)}
    order = np.random.default_rng(0)
    for round_index in range(args.rounds + 1):  # round 0 warms up
        for index in order.permutation(len(times)):
            name = list(times)[index]
            start = time.perf_counter()
            for _ in range(args.steps):
                if name == "plain":
                    p, o, out = plain(p, o, device_batch)
                else:
                    states[name], out = trainers[name].train_step(states[name], batches[name])
            jax.block_until_ready(out)
            if round_index:
                times[name].append((time.perf_counter() - start) / args.steps)
    fit_s, loop_s = fit_against_loop(trainers["parallax EP"], plain, params, tx, data, shape["batch"], args.steps)
    runs = []
    for name, seconds in times.items():
        ratios = sorted(a / b for a, b in zip(times["plain"], seconds))
        median = float(np.median(seconds))
        runs.append({"step": name, "seconds": sorted(seconds), "plain_over_this": [ratios[0], float(np.median(ratios)),
                                                                                   ratios[-1]],
                     "mfu": model_flops(shape) / median / peak if peak else None,
                     "first_loss_minus_plain": first_losses[name] - first_losses["plain"]})
        print(json.dumps(runs[-1]), flush=True)
    return {"device": kind, "jax": jax.__version__, "shape": shape, "steps_per_round": args.steps,
            "model_tflop": model_flops(shape) / 1e12, "xla_flops": xla_flops, "runs": runs,
            "fit_ep_s_per_step": fit_s, "plain_loop_s_per_step": loop_s}


def measure_peak(args) -> dict:
    """In a fresh process: the allocator's peak after real steps under ``ExpertParallel(1)``."""
    import jax
    import optax

    import parallax as px

    model, loss_fn, example, _, shape = build(args.small)
    trainer = px.Trainer(model, optax.adamw(3e-4), loss_fn, batch_size=shape["batch"], progress=False,
                         precision="bf16", strategy=px.ExpertParallel(1))
    state = trainer.init(example)
    batch = jax.device_put(example, trainer.batch_sharding)
    for _ in range(3):
        state, metrics = trainer.train_step(state, batch)
    jax.block_until_ready(metrics)
    stats = jax.devices()[0].memory_stats() or {}
    return {"peak_bytes_in_use": stats.get("peak_bytes_in_use", 0)}


def plan_peak(args) -> dict:
    """``px.plan``'s peak under ``ExpertParallel(1)`` on this process's backend (target gpu)."""
    import jax
    import optax

    import parallax as px

    model, loss_fn, example, _, _ = build(args.small)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), example)
    report = px.plan(model, optax.adamw(3e-4), shapes, loss_fn=loss_fn, strategies=[px.ExpertParallel(1)],
                     devices=[1], target="gpu", isolate=False, precision="bf16")
    row = report.rows[0]
    return {"backend": jax.default_backend(), "peak": row.get("peak"), "error": row.get("error")}


def child(mode: str, args, cpu: bool = False) -> dict:
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", **({"JAX_PLATFORMS": "cpu"} if cpu else {}))
    command = [sys.executable, "-m", "benchmarks.gpu_moe", f"--{mode}"] + (["--small"] if args.small else [])
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if not done.returncode and lines else {"failed": done.stderr[-2000:]}


def memory(args) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    jobs = (("measure-peak", False), ("plan-peak", False), ("plan-peak", True))
    with ThreadPoolExecutor(3) as pool:
        measured, here, on_cpu = pool.map(lambda job: child(*job[:1], args, cpu=job[1]), jobs)
    result = {"measured": measured, "plan_here": here, "plan_on_cpu": on_cpu}
    print(json.dumps(result), flush=True)
    return result


def markdown(result: dict) -> str:
    import numpy as np

    lines = []
    part = result.get("speed") or {}
    if "runs" in part:
        lines += [f"## A Switch MoE on one {part['device']}, jax {part['jax']}", "",
                  f"{part['shape']}; bf16, AdamW; {part['model_tflop']:.2f} TFLOP of useful work per step; "
                  f"{part['steps_per_round']} steps per round, interleaved.", "",
                  "| step | s per step (median) | plain ÷ this, median (min–max) | MFU | first loss − plain |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        for run in part["runs"]:
            low, mid, high = run["plain_over_this"]
            mfu = f"{run['mfu']:.1%}" if run["mfu"] else "-"
            lines.append(f"| {run['step']} | {float(np.median(run['seconds'])):.4f} | {mid:.3f} ({low:.3f}–{high:.3f}) "
                         f"| {mfu} | {run['first_loss_minus_plain']:.1e} |")
        lines += ["", f"`Trainer.fit` under ExpertParallel(1): {part['fit_ep_s_per_step']:.4f} s per step; "
                      f"a plain loop over the same batches: {part['plain_loop_s_per_step']:.4f}.", ""]
    mem = result.get("memory") or {}
    if "measured" in mem:
        measured = mem["measured"].get("peak_bytes_in_use")
        here, cpu = mem["plan_here"].get("peak"), mem["plan_on_cpu"].get("peak")
        error = (lambda planned: f"{planned / measured - 1:+.2%}" if measured and planned else "-")
        gib = (lambda b: f"{b / 2**30:.3f} GiB" if b else "-")
        lines += ["## Peak device memory under ExpertParallel(1): px.plan against the allocator", "",
                  "| measured peak | px.plan on this GPU | error | px.plan on CPU (target gpu) | error |",
                  "| --- | --- | --- | --- | --- |",
                  f"| {gib(measured)} | {gib(here)} | {error(here)} | {gib(cpu)} | {error(cpu)} |", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--timeout", type=int, default=300)
    parser.add_argument("--out", default=None)
    parser.add_argument("--measure-peak", dest="measure", action="store_true")
    parser.add_argument("--plan-peak", dest="plan", action="store_true")
    args = parser.parse_args()
    if args.measure or args.plan:
        print(json.dumps(measure_peak(args) if args.measure else plan_peak(args), default=str), flush=True)
        return
    run_parts((("speed", speed), ("memory", memory)), args, "gpu_moe", markdown)


if __name__ == "__main__":
    main()
