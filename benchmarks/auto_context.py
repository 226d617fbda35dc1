"""What ``strategy="auto"`` picks for a few long sequences, measured against every context mesh it
priced (``python -m benchmarks.auto_context``).

The causal LM of ``benchmarks/context_speed.py`` (``TransformerLM``: 2 blocks of linen's
``nn.MultiHeadDotProductAttention`` with ``nn.make_causal_mask``, width 64, 4 heads) on a batch of
2 sequences over 8 devices: data parallelism and FSDP cannot split 2 rows 8 ways, so the search
prices the tensor meshes and the context meshes (gathered, ring, and each load-balanced). The
search runs as the Trainer runs it (:func:`parallax.state.search.resolve`: priced by the cost
model, the closest few timed); then the pick and every context mesh it priced are timed in
interleaved rounds (each the mean of 3 steps) on the same simulated devices. ``pick ÷`` is the
pick's step time over the row's within each round (min / median / max over rounds): below 1 the
pick is faster. On 8 simulated devices sharing 2 CPU cores a step's time is every device's work
summed, not the busiest device's.
"""

from benchmarks import side_runner_args

LENGTHS = (1024, 2048)


def main() -> None:
    args = side_runner_args(__doc__, models="lm", rounds=5)
    import jax
    import numpy as np
    import optax

    from benchmarks import report, time_interleaved
    from benchmarks.context_speed import LMSteps
    from benchmarks.models import TransformerLM, lm_loss
    from parallax.parallel.candidates import context_candidates, from_mesh
    from parallax.state.search import resolve

    results = []
    for length in LENGTHS[:1] if args.smoke else LENGTHS:
        batch = {"x": np.random.default_rng(0).integers(0, 256, (2, length + 1)).astype(np.int32)}
        found = resolve(TransformerLM(vocab=256, features=64, layers=2, heads=4), optax.adamw(1e-3), batch, "auto",
                        loss_fn=lm_loss, devices=jax.devices()[:8])
        picked = found.strategy.describe(found.mesh)
        print(found.describe())
        priced = {label.rsplit(", ", 1)[0]: estimate for label, estimate in found.choice.estimates.items()}
        contexts = [label for label in priced if label.startswith("ContextParallel") and label != picked]
        strategies = {strategy.describe(): strategy for strategy in context_candidates(8)}
        runners = [LMSteps(length, from_mesh(found.mesh), rows=2)]
        runners += [LMSteps(length, strategies[label], rows=2) for label in contexts]
        time_interleaved(runners, args.rounds)
        pick = runners[0]
        for runner, label in zip(runners, [picked, *contexts]):
            ratios = sorted(a / b for a, b in zip(pick.times, runner.times))
            rates = sorted(runner.tokens / t for t in runner.times)
            results.append({"length": length, "strategy": label, "picked": runner is pick,
                            "estimate": priced[label].seconds, "tokens_per_s": [rates[0], float(np.median(rates)),
                                                                                 rates[-1]],
                            "pick_over": None if runner is pick else [ratios[0], float(np.median(ratios)), ratios[-1]],
                            "peak": runner.peak, "moved": runner.moved})

    def markdown(rows, meta):
        lines = ["| tokens | strategy | est. step | tokens/s (min / median / max) | pick ÷ (min / median / max) "
                 "| peak per device |", "| ---: | --- | ---: | ---: | ---: | ---: |"]
        for r in rows:
            low, mid, high = r["tokens_per_s"]
            over = "**picked**" if r["picked"] else " / ".join(f"{x:.2f}" for x in r["pick_over"])
            lines.append(f"| {r['length']} | {r['strategy']} | {1e3 * r['estimate']:.0f} ms | "
                         f"{low:,.0f} / {mid:,.0f} / {high:,.0f} | {over} | {r['peak'] / 2**20:.1f} MiB |")
        return "\n".join(lines)

    report(args, "auto_context", results, markdown, batch=2)


if __name__ == "__main__":
    main()
