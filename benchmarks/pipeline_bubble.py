"""The pipeline's bubble, measured against theory (``python -m benchmarks.pipeline_bubble``).

In an SPMD pipeline every stage computes in every iteration: the ``S - 1`` iterations in which a
stage has no microbatch yet (or no longer) compute discarded work. A step runs ``R·M + S - 1``
iterations of one microbatch's layer group each, where ``R·M`` would do, so its stack costs
``(R·M + S - 1) / (R·M)`` times the bubble-free time, whatever the hardware. This runner trains a
deep MLP stack (the stack dominates the step) under ``DataParallel(2) × PipelineParallel(4)`` on
8 simulated devices, for several microbatch counts ``M`` (GPipe) and with ``repeats=2``
(circular), times the compiled steps in interleaved rounds, and prints each configuration's step
time relative to the one with the most microbatches against the same ratio of the predicted
factors: measured ÷ predicted, goal within 10%. ``--models lm`` runs the benchmark LM instead
(``benchmarks/models.py``'s ``TransformerLM``, 8 blocks kept in a list, pipelined with
``blocks="Block"``): results in ``pipeline_bubble_lm.{md,json}``.
"""

from benchmarks import side_runner_args

CONFIGS = [("gpipe", 1, m) for m in (1, 2, 4, 8, 16)] + [("circular", 2, m) for m in (4, 8, 16)]


def main() -> None:
    args = side_runner_args(__doc__, models="mlp", rounds=7)
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import parallax as px
    from benchmarks import TimedSteps, report, time_interleaved

    lm = args.models == "lm"
    width, layers, rows = (64, 8, 64) if args.smoke else ((128, 8, 64) if lm else (512, 8, 512))

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            return h + nn.Dense(width)(jnp.tanh(nn.Dense(width)(h))), None

    class Deep(nn.Module):
        @nn.compact
        def __call__(self, x):
            blocks = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=layers)
            return blocks(name="blocks")(x, None)[0]

    def loss_fn(model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(rows, width)).astype(np.float32),
             "y": rng.normal(size=(rows, width)).astype(np.float32)}
    make, blocks, what = Deep, None, f"Deep MLP stack ({layers} blocks of width {width}, {rows} rows)"
    if lm:  # the benchmark LM: its blocks in a list, named for the pipeline
        from benchmarks.models import TransformerLM

        sequence = 32
        make, blocks = (lambda: TransformerLM(vocab=256, features=width, layers=layers, heads=4)), "Block"
        what = f"Benchmark LM ({layers} blocks in a list of width {width}, {rows} rows of {sequence} tokens)"
        batch = {"tokens": rng.integers(0, 256, size=(rows, sequence + 1)).astype(np.int32)}

        def loss_fn(model, batch):
            logits = model(batch["tokens"][:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()

    class Runner(TimedSteps):
        def __init__(self, schedule: str, repeats: int, microbatches: int):
            self.label, self.times = f"{schedule} R={repeats} M={microbatches}", []
            self.factor = (repeats * microbatches + 3) / (repeats * microbatches)  # S = 4
            self.schedule, self.repeats, self.microbatches = schedule, repeats, microbatches
            strategy = px.combine(px.DataParallel(2), px.PipelineParallel(4, microbatches=microbatches,
                                                                          schedule=schedule, repeats=repeats,
                                                                          blocks=blocks))
            self.state = px.init_state(make(), optax.sgd(1e-3), batch, strategy=strategy, loss_fn=loss_fn)
            self.step = px.make_train_step(loss_fn, strategy, compile="jit")
            mesh = strategy.make_mesh()
            self.batch = jax.device_put(batch, jax.sharding.NamedSharding(mesh, strategy.batch_spec()))
            self.state, metrics = self.step(self.state, self.batch)
            jax.block_until_ready(metrics)

    runners = [Runner(*config) for config in CONFIGS]
    time_interleaved(runners, args.rounds)
    reference = runners[4]  # gpipe M=16: the smallest bubble of the GPipe runs
    results = []
    for runner in runners:
        ratios = sorted(t / r for t, r in zip(runner.times, reference.times))
        predicted = runner.factor / reference.factor
        results.append({"config": runner.label, "schedule": runner.schedule, "repeats": runner.repeats,
                        "microbatches": runner.microbatches, "iterations": runner.repeats * runner.microbatches + 3,
                        "step_s": float(np.median(runner.times)),
                        "measured_ratio": [ratios[0], float(np.median(ratios)), ratios[-1]],
                        "predicted_ratio": predicted, "measured_over_predicted": float(np.median(ratios)) / predicted})

    # Time per step = a × iterations × layers per iteration (a fixed cost per layer step of the loop,
    # whatever the microbatch's size) + b × iterations / (R·M) (each iteration computes one
    # microbatch's share of the batch through a group of L/(S·R) layers: the bubble theory): least squares.
    features = np.array([[row["iterations"] * layers // (4 * row["repeats"]),
                          row["iterations"] / (row["repeats"] * row["microbatches"])] for row in results])
    measured = np.array([row["step_s"] for row in results])
    (per_iteration, per_pass), *_ = np.linalg.lstsq(features, measured, rcond=None)
    for row, fitted in zip(results, features @ np.array([per_iteration, per_pass])):
        row["fitted_s"], row["measured_over_fitted"] = float(fitted), row["step_s"] / float(fitted)

    def markdown(results, meta):
        lines = [f"{what}, DataParallel(2) × PipelineParallel(4), "
                 f"{meta['rounds']} interleaved rounds; ratios against GPipe M=16.", "",
                 "| configuration | iterations | step s (median) | measured ratio, median (min–max) | predicted | "
                 "measured ÷ predicted | measured ÷ fitted |", "| --- " * 7 + "|"]
        for row in results:
            low, mid, high = row["measured_ratio"]
            lines.append(f"| {row['config']} | {row['iterations']} | {row['step_s']:.4f} "
                         f"| {mid:.3f} ({low:.3f}–{high:.3f}) | {row['predicted_ratio']:.3f} "
                         f"| {row['measured_over_predicted']:.3f} | {row['measured_over_fitted']:.3f} |")
        lines += ["", f"Fitted: {1e3 * meta['per_iteration_s']:.1f} ms per layer step of the loop + "
                      f"{1e3 * meta['per_pass_s']:.1f} ms per pass of the whole batch through a stage's layers."]
        return "\n".join(lines) + "\n"

    report(args, "pipeline_bubble_lm" if lm else "pipeline_bubble", results, markdown, model=args.models, width=width,
           layers=layers, rows=rows, per_iteration_s=float(per_iteration), per_pass_s=float(per_pass))


if __name__ == "__main__":
    main()
