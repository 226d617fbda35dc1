"""parallax on a real accelerator: the Trainer against a plain optax loop, and ``px.plan``'s peak
against the device's own count (``python -m benchmarks.gpu``).

Two questions the simulated CPU devices cannot answer:

- **Speed on one accelerator.** The same transformer LM, the same AdamW, the same batch: a
  plain ``jax.jit`` optax step (what a user writes without parallax) against parallax's
  compiled step (``Trainer.train_step``), timed in interleaved rounds in one process, each a
  burst of steps ended by ``block_until_ready``; and a whole ``Trainer.fit`` (host data,
  callbacks, metrics read back) against a plain loop feeding the same numpy batches. Model
  FLOPs utilisation (MFU) = the plain step's FLOPs (XLA's ``cost_analysis()``) ÷ step time ÷
  the chip's dense peak for the compute dtype.
- **Memory before the run.** ``px.plan``'s peak per device (arguments + outputs − donated +
  temporaries of the compiled step) against ``memory_stats()["peak_bytes_in_use"]`` after
  real steps, each configuration in a fresh process (the allocator's peak cannot be reset),
  planned on the accelerator itself and, as a user without one would, on CPU with
  ``target="gpu"``.

``--small`` runs tiny shapes on whatever backend is present (a check of this script).
"""

import argparse
import json
import os
import subprocess
import sys
import time

# Dense peak FLOP/s by device kind and compute dtype (vendor data sheets, no sparsity); "fp32" is
# TF32 on the tensor cores, what float32 matmuls run as under JAX's default precision on GPU.
PEAK_FLOPS = {"H200": {"bf16": 989e12, "fp32": 494e12}, "H100": {"bf16": 989e12, "fp32": 494e12}}
MEMORY_CONFIGS = {"fp32": {}, "bf16": {"precision": "bf16"}, "bf16+remat": {"precision": "bf16", "remat": ("Block",)},
                  "bf16+offload": {"precision": "bf16", "offload": "optimizer"},
                  # Measured later (2026-11-29), each planned from the CPU first: other options, another width, and
                  # a Llama-shaped scanned stack (benchmarks/llama.py) of ~0.6B params.
                  "fp32+remat": {"remat": ("Block",)}, "bf16+accum4": {"precision": "bf16", "grad_accum": 4},
                  "bf16 wide": {"precision": "bf16"}, "llama bf16": {}}
# Configurations on another model or shape than build()'s default: the shape's overrides (or "llama").
SHAPES = {"bf16 wide": {"dim": 2048, "layers": 4, "batch": 8}, "llama bf16": "llama"}


def build(small: bool, config: str | None = None):
    """The model, its loss, an example batch (numpy) and the data for ``fit`` (``config``'s shape, see
    ``SHAPES``)."""
    import flax.linen as nn
    import numpy as np
    import optax

    if SHAPES.get(config) == "llama":
        return build_llama(small)
    dim, heads, layers, vocab, batch, length = (64, 4, 2, 512, 4, 64) if small else (1024, 16, 8, 32_000, 16, 1024)
    if not small and isinstance(SHAPES.get(config), dict):
        over = SHAPES[config]
        dim, layers, batch = over.get("dim", dim), over.get("layers", layers), over.get("batch", batch)

    class Block(nn.Module):
        dim: int
        heads: int

        @nn.compact
        def __call__(self, x):
            h = nn.LayerNorm()(x)
            x = x + nn.MultiHeadDotProductAttention(self.heads, name="attn")(h, h, mask=nn.make_causal_mask(x[..., 0]))
            h = nn.LayerNorm()(x)
            return x + nn.Dense(self.dim, name="down")(nn.gelu(nn.Dense(4 * self.dim, name="up")(h)))

    class Transformer(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(vocab, dim, name="embed")(tokens)
            for i in range(layers):
                x = Block(dim, heads, name=f"block_{i}")(x)
            return nn.Dense(vocab, name="head")(nn.LayerNorm()(x))

    def loss_fn(model, batch):
        logits = model(batch["tokens"][:, :-1]).astype("float32")
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()

    rng = np.random.default_rng(0)
    data = {"tokens": rng.integers(0, vocab, (batch * 40, length + 1), dtype=np.int32)}
    example = {"tokens": data["tokens"][:batch]}
    shape = {"dim": dim, "heads": heads, "layers": layers, "vocab": vocab, "batch": batch, "tokens": length}
    return Transformer(), loss_fn, example, data, shape


def build_llama(small: bool):
    """A Llama-shaped scanned stack (GQA, SwiGLU, RMSNorm, bf16 compute over float32 params, every block
    rematerialised): ``build()``'s five values."""
    import numpy as np

    from benchmarks import llama

    shape = llama.Shape(layers=8, dim=2048, ffn=8192, heads=16, kv_heads=8, vocab=32_000)
    batch, length = 4, 2048
    if small:
        shape, batch, length = shape._replace(layers=2, dim=64, ffn=128, heads=4, kv_heads=2, vocab=512), 2, 64
    rng = np.random.default_rng(0)
    data = {"tokens": rng.integers(0, shape.vocab, (batch * 40, length + 1), dtype=np.int32)}
    described = {"dim": shape.dim, "heads": shape.heads, "layers": shape.layers, "vocab": shape.vocab,
                 "batch": batch, "tokens": length, "ffn": shape.ffn, "kv_heads": shape.kv_heads}
    return llama.Llama(shape), llama.loss_fn, {"tokens": data["tokens"][:batch]}, data, described


def plain_step(model, loss_fn, tx, precision: str):
    """The step a user writes without parallax: value_and_grad, optax update, donated state."""
    import jax
    import jax.numpy as jnp
    import optax

    class Bound:  # loss_fn(model, batch) calls model(x): bind the params, as parallax's linen adapter does
        def __init__(self, params):
            self.params = params

        def __call__(self, *args):
            return model.apply({"params": self.params}, *args)

    def loss(params, batch):
        if precision == "bf16":  # float32 master params, bf16 compute
            params = jax.tree.map(lambda p: p.astype(jnp.bfloat16) if p.dtype == jnp.float32 else p, params)
        return loss_fn(Bound(params), batch)

    def step(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return jax.jit(step, donate_argnums=(0, 1))


def model_flops(shape: dict) -> float:
    """FLOPs of one training step counted from the model's shapes (forward + backward = 3 ×
    forward): 6 × matmul params × tokens, plus q·kᵀ and weights·v over the full (masked, not
    skipped) sequence. XLA's ``cost_analysis()`` on GPU leaves out the library (cuBLAS) calls."""
    d, layers, tokens = shape["dim"], shape["layers"], shape["batch"] * shape["tokens"]
    matmul_params = layers * 12 * d * d + d * shape["vocab"]  # q, k, v, out, up, down; the head
    return 6 * matmul_params * tokens + 12 * layers * shape["batch"] * shape["tokens"] ** 2 * d


def markdown(result: dict) -> str:
    """The tables of ``gpu.md`` from a result (``speed`` and ``memory``)."""
    import numpy as np

    lines = []
    speed_part = result.get("speed") or {}
    if "runs" in speed_part:
        shape = speed_part["shape"]
        flops = model_flops(shape)
        peaks = next((v for k, v in PEAK_FLOPS.items() if k in speed_part["device"]), {})
        lines += [f"## Speed: {speed_part['device']}, jax {speed_part['jax']}", "",
                  f"Transformer LM {shape}; AdamW; {flops / 1e12:.2f} TFLOP per step (model FLOPs); "
                  f"{speed_part['steps_per_round']} steps per round, interleaved.", "",
                  "| precision | parallax step s | plain step s | plain ÷ parallax, median (min–max) "
                  "| MFU parallax | MFU plain | Trainer.fit s/step | plain loop s/step | first loss parallax − plain |",
                  "| --- " * 9 + "|"]
        for run in speed_part["runs"]:
            low, mid, high = run["plain_over_parallax"]
            px_s, plain_s = float(np.median(run["parallax_s"])), float(np.median(run["plain_s"]))
            peak = peaks.get(run["precision"])
            mfu = (lambda t, peak=peak: f"{flops / t / peak:.1%}") if peak else (lambda t: "-")
            first = run["first_loss_plain_parallax"]
            lines.append(f"| {run['precision']} | {px_s:.4f} | {plain_s:.4f} | {mid:.3f} ({low:.3f}–{high:.3f}) | "
                         f"{mfu(px_s)} | {mfu(plain_s)} | {run['fit_s_per_step']:.4f} "
                         f"| {run['plain_loop_s_per_step']:.4f} | {first[1] - first[0]:.1e} |")
        lines.append("")
    if isinstance(result.get("memory"), list):
        lines += ["## Peak device memory: px.plan against the allocator", "",
                  "| configuration | measured peak | px.plan on this GPU | error | px.plan on CPU (target gpu) "
                  "| error | step s |",
                  "| --- " * 7 + "|"]
        for row in result["memory"]:
            measured = row["measured"].get("peak_bytes_in_use")
            here, cpu = row["plan_here"].get("peak"), row["plan_on_cpu"].get("peak")
            error = (lambda planned, measured=measured:
                     f"{planned / measured - 1:+.2%}" if measured and planned else "-")
            step = row["measured"].get("step_s")
            lines.append(f"| {row['config']} | {measured / 2**30:.3f} GiB | {here / 2**30:.3f} GiB | {error(here)} | "
                         f"{cpu / 2**30:.3f} GiB | {error(cpu)} | {f'{step:.4f}' if step else '-'} |")
        lines.append("")
    return "\n".join(lines)


def flops_of(compiled) -> float:
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
    return float(analysis.get("flops", 0.0))


def speed(args) -> dict:
    """Step and fit times of parallax and the plain loop, per precision, interleaved rounds."""
    import jax
    import numpy as np
    import optax

    import parallax as px

    model, loss_fn, example, data, shape = build(args.small)
    kind = jax.devices()[0].device_kind
    peak = next((v for k, v in PEAK_FLOPS.items() if k in kind), None)
    results = {"device": kind, "jax": jax.__version__, "shape": shape, "steps_per_round": args.steps, "runs": []}
    for precision in ("fp32", "bf16"):
        tx = optax.adamw(3e-4)
        trainer = px.Trainer(model, tx, loss_fn, batch_size=shape["batch"], max_steps=args.steps, shuffle=False,
                             progress=False, precision=precision if precision == "bf16" else None)
        state = trainer.init(example)
        batch = jax.device_put(example, trainer.batch_sharding)
        params = jax.tree.map(lambda x: np.asarray(x), state.params)  # the same initial params for both
        plain = plain_step(model, loss_fn, tx, precision)
        p, o = jax.device_put(params), tx.init(jax.device_put(params))
        device_batch = jax.device_put(example)
        flops = flops_of(plain.lower(p, o, device_batch).compile())
        p, o, first_plain = plain(p, o, device_batch)  # the first step of each from the same params
        state, metrics = trainer.train_step(state, batch)
        first_losses = [float(first_plain), float(metrics["loss"])]
        times = {"parallax": [], "plain": []}
        for round_index in range(args.rounds + 1):  # round 0 compiles and warms up
            for name in (("parallax", "plain") if round_index % 2 else ("plain", "parallax")):
                start = time.perf_counter()
                for _ in range(args.steps):
                    if name == "plain":
                        p, o, loss = plain(p, o, device_batch)
                    else:
                        state, metrics = trainer.train_step(state, batch)
                jax.block_until_ready(loss if name == "plain" else metrics)
                if round_index:
                    times[name].append((time.perf_counter() - start) / args.steps)
        ratios = sorted(a / b for a, b in zip(times["plain"], times["parallax"]))
        fit_time, loop_time = fit_against_loop(trainer, plain, params, tx, data, shape["batch"], args.steps)
        run = {"precision": precision, "xla_flops_per_step": flops, "first_loss_plain_parallax": first_losses,
               "parallax_s": sorted(times["parallax"]), "plain_s": sorted(times["plain"]),
               "plain_over_parallax": [ratios[0], float(np.median(ratios)), ratios[-1]],
               "fit_s_per_step": fit_time, "plain_loop_s_per_step": loop_time}
        if peak:
            run["mfu_parallax"] = model_flops(shape) / float(np.median(times["parallax"])) / peak[precision]
            run["mfu_plain"] = model_flops(shape) / float(np.median(times["plain"])) / peak[precision]
        results["runs"].append(run)
        print(json.dumps(run), flush=True)
    return results


def fit_against_loop(trainer, plain, params, tx, data, batch_size: int, steps: int) -> tuple[float, float]:
    """Seconds per step of ``Trainer.fit`` (its second call: compiled) and of a plain loop over
    the same numpy batches, each the best of two."""
    import jax

    trainer.fit(data)
    fits, loops = [], []
    for _ in range(2):
        start = time.perf_counter()
        trainer.fit(data)
        fits.append((time.perf_counter() - start) / steps)
        p = jax.device_put(params)
        o = tx.init(p)
        start = time.perf_counter()
        for i in range(steps):
            p, o, loss = plain(p, o, {"tokens": data["tokens"][i * batch_size:(i + 1) * batch_size]})
        jax.block_until_ready(loss)
        loops.append((time.perf_counter() - start) / steps)
    return min(fits), min(loops)


def measure_peak(args) -> dict:
    """In a fresh process: the allocator's peak after real steps of one configuration."""
    import jax
    import optax

    import parallax as px

    model, loss_fn, example, _, shape = build(args.small, args.config)
    trainer = px.Trainer(model, optax.adamw(3e-4), loss_fn, batch_size=shape["batch"], progress=False,
                         **MEMORY_CONFIGS[args.config])
    state = trainer.init(example)
    batch = jax.device_put(example, trainer.batch_sharding)
    stats = jax.devices()[0].memory_stats() or {}
    before = stats.get("peak_bytes_in_use", 0)
    state, metrics = trainer.train_step(state, batch)  # compiles (autotuning may allocate), then runs
    jax.block_until_ready(metrics)
    after_first = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0)
    bursts = []
    for _ in range(3):  # three bursts of five steps: the median burst's seconds a step
        start = time.perf_counter()
        for _ in range(5):
            state, metrics = trainer.train_step(state, batch)
        jax.block_until_ready(metrics)
        bursts.append((time.perf_counter() - start) / 5)
    seconds = sorted(bursts)[1]
    stats = jax.devices()[0].memory_stats() or {}
    return {"config": args.config, "peak_before_step": before, "peak_after_first_step": after_first,
            "peak_bytes_in_use": stats.get("peak_bytes_in_use", 0), "bytes_in_use": stats.get("bytes_in_use", 0),
            "step_s": seconds, "step_s_bursts": bursts}


def plan_peak(args) -> dict:
    """``px.plan``'s peak for one configuration on this process's backend (target gpu)."""
    import jax
    import optax

    import parallax as px

    model, loss_fn, example, _, _ = build(args.small, args.config)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), example)
    report = px.plan(model, optax.adamw(3e-4), shapes, loss_fn=loss_fn, strategies=["dp"], devices=[1],
                     target="gpu", isolate=False, **MEMORY_CONFIGS[args.config])
    row = report.rows[0]
    return {"config": args.config, "backend": jax.default_backend(), "peak": row.get("peak"),
            "state": row.get("state"), "compiled": row.get("compiled"), "error": row.get("error")}


def child(mode: str, config: str, args, cpu: bool = False) -> dict:
    env = dict(os.environ, **({"JAX_PLATFORMS": "cpu"} if cpu else {}))
    command = [sys.executable, "-m", "benchmarks.gpu", f"--{mode}", config] + (["--small"] if args.small else [])
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        return {"config": config, "failed": done.stderr[-2000:]}
    return json.loads(lines[-1])


def memory(args) -> list[dict]:
    """Each configuration measured and planned in its own processes, several at a time (each
    process's allocator counts only its own buffers; none preallocates the device's memory)."""
    from concurrent.futures import ThreadPoolExecutor

    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    jobs = [(config, mode, cpu) for config in args.configs.split(",")
            for mode, cpu in (("measure-peak", False), ("plan-peak", False), ("plan-peak", True))]
    with ThreadPoolExecutor(args.parallel) as pool:
        done = list(pool.map(lambda job: child(job[1], job[0], args, cpu=job[2]), jobs))
    rows = []
    for config in args.configs.split(","):
        found = [result for (name, _, _), result in zip(jobs, done) if name == config]
        row = {"config": config, "measured": found[0], "plan_here": found[1], "plan_on_cpu": found[2]}
        print(json.dumps({"config": config, "measured_peak": found[0].get("peak_bytes_in_use"),
                          "plan_here": found[1].get("peak"), "plan_on_cpu": found[2].get("peak"),
                          "failed": [r["failed"][-300:] for r in found if "failed" in r]}), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--configs", default=",".join(MEMORY_CONFIGS))
    parser.add_argument("--only", choices=("speed", "memory"), default=None)
    parser.add_argument("--timeout", type=int, default=240)
    parser.add_argument("--parallel", type=int, default=6, help="memory processes at a time")
    parser.add_argument("--out", default=None)
    parser.add_argument("--measure-peak", dest="measure", default=None)
    parser.add_argument("--plan-peak", dest="plan", default=None)
    args = parser.parse_args()
    if args.measure or args.plan:
        args.config = args.measure or args.plan
        print(json.dumps(measure_peak(args) if args.measure else plan_peak(args), default=str), flush=True)
        return
    parts = (("speed", speed), ("memory", memory))  # speed first, on a quiet device
    run_parts([(name, run) for name, run in parts if args.only in (None, name)], args, "gpu", markdown)


def run_parts(parts, args, name: str, markdown) -> None:
    """Runs each ``(part, run)`` of ``parts`` on ``args`` in turn, keeping what the others measured
    when one fails; writes ``out/name.json`` after each and ``out/name.md`` (``markdown(result)``,
    also printed) at the end."""
    result = {}
    for part, run in parts:
        try:
            result[part] = run(args)
        except Exception as err:  # keep what the other part measured
            result[part] = {"failed": repr(err)}
            print(f"{part} failed: {err!r}", flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"{name}.json"), "w") as f:
                json.dump(result, f, indent=1, default=str)
    text = markdown(result)
    print(text)
    if args.out:
        with open(os.path.join(args.out, f"{name}.md"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
