"""A list of blocks pipelined against the same blocks stacked (``python -m benchmarks.pipeline_listed``).

Users write a transformer's blocks two ways: a scanned stack (``nn.scan``, as MaxText does) and a
Hugging Face–style list (``layers_0``, ``layers_1``, ...). A pipeline over either should cost the
same: the same layers, the same schedule. This runner builds the Llama-shaped model of
``benchmarks/llama.py`` both ways (float32, each block ``nn.remat``'d, as large runs are), with the
same initial params, and compares, under ``PipelineParallel(2) × FSDP(4)`` (by default, each
iteration's input kept; and with ``remat="layer"``, each block's) and with ``FSDP(8)`` beside it:
the compiled step's peak per device (``memory_analysis()``), its matmul FLOPs per device (read from
the step's jaxpr, as ``px.plan`` prices them: the compiler's count sees a loop body once), and the
step time, timed in interleaved rounds; each ratio (listed ÷ stacked, and each over FSDP(8) stacked)
per round, median (min–max). Goal: listed within 10% of stacked, peak and time.
"""

from benchmarks import side_runner_args


def main() -> None:
    args = side_runner_args(__doc__, models="llama", rounds=7)
    import jax
    import numpy as np
    import optax

    import parallax as px
    from benchmarks import TimedSteps, report, time_interleaved
    from benchmarks.llama import ListedLlama, Llama, Shape, listed_params, loss_fn
    from parallax.pricing.fused_bytes import dot_flops

    shape = Shape(layers=8, dim=128, ffn=256, heads=4, kv_heads=2, vocab=256, dtype="float32")
    rows, sequence = 16, 64
    if args.smoke:
        shape, rows, sequence = shape._replace(layers=4, dim=32, ffn=64), 8, 16
    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(0, shape.vocab, size=(rows, sequence + 1)).astype(np.int32)}
    stacked_params = Llama(shape).init(jax.random.key(0), batch["tokens"][:, :-1])["params"]

    strategies = {"FSDP(8)": lambda: px.FSDP(8, min_weight_size=1),
                  "PP(2) × FSDP(4)": lambda: px.combine(px.PipelineParallel(2, microbatches=4),
                                                        px.FSDP(4, min_weight_size=1)),
                  "PP(2, remat='layer') × FSDP(4)": lambda: px.combine(
                      px.PipelineParallel(2, microbatches=4, remat="layer"), px.FSDP(4, min_weight_size=1))}

    class Runner(TimedSteps):
        def __init__(self, written: str, strategy_name: str):
            self.written, self.strategy_name, self.times = written, strategy_name, []
            model = Llama(shape) if written == "stacked" else ListedLlama(shape)
            params = stacked_params if written == "stacked" else listed_params(stacked_params, shape.layers)
            strategy = strategies[strategy_name]()
            self.state = px.init_state(model, optax.adamw(1e-3), batch, strategy=strategy, loss_fn=loss_fn,
                                       params=params)
            self.step = px.make_train_step(loss_fn, strategy, compile="jit")
            self.batch = jax.device_put(batch, jax.sharding.NamedSharding(strategy.make_mesh(), strategy.batch_spec()))
            memory = self.step.lower(self.state, self.batch).compile().memory_analysis()
            self.peak = (memory.temp_size_in_bytes + memory.argument_size_in_bytes + memory.output_size_in_bytes
                         - memory.alias_size_in_bytes)
            whole, local = dot_flops(self.step.trace(self.state, self.batch).jaxpr.jaxpr)
            self.flops = whole / jax.device_count() + local
            self.state, metrics = self.step(self.state, self.batch)
            self.first_loss = float(metrics["loss"])
            jax.block_until_ready(metrics)

    runners = [Runner(written, name) for name in strategies for written in ("stacked", "listed")]
    time_interleaved(runners, args.rounds)
    base = runners[0]  # FSDP(8), stacked
    results = []
    for runner in runners:
        twin = next(r for r in runners if r.strategy_name == runner.strategy_name and r.written == "stacked")
        spread = lambda other, runner=runner: sorted(t / o for t, o in zip(runner.times, other.times))
        over_stacked, over_fsdp = spread(twin), spread(base)
        results.append({"written": runner.written, "strategy": runner.strategy_name, "peak_bytes": int(runner.peak),
                        "flops_per_device": runner.flops, "step_s": float(np.median(runner.times)),
                        "first_loss": runner.first_loss,
                        "time_over_stacked": [over_stacked[0], float(np.median(over_stacked)), over_stacked[-1]],
                        "time_over_fsdp8": [over_fsdp[0], float(np.median(over_fsdp)), over_fsdp[-1]],
                        "peak_over_stacked": runner.peak / twin.peak, "flops_over_stacked": runner.flops / twin.flops})

    def markdown(results, meta):
        lines = [f"Llama-shaped, {meta['layers']} remat'd blocks of width {meta['dim']} (float32), {meta['rows']} rows "
                 f"of {meta['sequence']} tokens, AdamW, {meta['devices']} CPU devices, {meta['rounds']} interleaved "
                 "rounds; ratios per round, median (min–max).", "",
                 "| written as | strategy | peak MiB | ÷ stacked | matmul GFLOP/device | ÷ stacked | step s | "
                 "time ÷ stacked | time ÷ FSDP(8) stacked |", "| --- " * 9 + "|"]
        for row in results:
            a, b = row["time_over_stacked"], row["time_over_fsdp8"]
            lines.append(f"| {row['written']} | {row['strategy']} | {row['peak_bytes'] / 2**20:.1f} | "
                         f"{row['peak_over_stacked']:.3f} | {row['flops_per_device'] / 1e9:.2f} | "
                         f"{row['flops_over_stacked']:.3f} | {row['step_s']:.3f} | "
                         f"{a[1]:.3f} ({a[0]:.3f}–{a[2]:.3f}) | {b[1]:.3f} ({b[0]:.3f}–{b[2]:.3f}) |")
        return "\n".join(lines) + "\n"

    report(args, "pipeline_listed", results, markdown, layers=shape.layers, dim=shape.dim, rows=rows,
           sequence=sequence)


if __name__ == "__main__":
    main()
