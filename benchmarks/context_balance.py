"""Context parallelism with and without load balancing on a causal LM: tiles of scores per device,
step time, peak (``python -m benchmarks.context_balance``).

The causal LM of ``benchmarks/context_speed.py`` (``TransformerLM``: 2 blocks of linen's
``nn.MultiHeadDotProductAttention`` with ``nn.make_causal_mask``, width 64, 4 heads) trains on a batch
of 8 sequences on 8 devices under ``ContextParallel(c) × DataParallel(8 / c)``, the context axis
with ``load_balance`` off (every tile of the scores computed: the causal mask's hidden half too) and
on (the hidden tiles skipped, the sequence in zig-zag order inside each attention). Per device, the
tiles of scores each attention computes are counted by running the balanced attention itself
(``parallax.parallel.context.attention.tiles_computed``, of ``4 × c``); the unbalanced one computes
all of them. Step times in interleaved rounds (each the mean of 3 steps); ``balanced ÷ unbalanced``
is the ratio of the two step times within each round (min / median / max over rounds). On 8 simulated
devices sharing 2 CPU cores every device's work runs on the same cores, so the time saved is the work
skipped summed over the devices, not the busiest device's; the per-device tile counts say how a GPU's
devices would share it.
"""

from benchmarks import side_runner_args

CONFIGS = ((1024, 2), (1024, 8), (2048, 8))  # (tokens, context size)
METHODS = ("all_gather", "ring")


def main() -> None:
    args = side_runner_args(__doc__, models="lm", rounds=5)
    import flax.linen as nn
    import jax
    import numpy as np

    import parallax as px
    from benchmarks import report, time_interleaved
    from benchmarks.context_speed import LMSteps
    from parallax.parallel.context.attention import tiles_computed

    class Runner(LMSteps):
        def __init__(self, length: int, context: int, method: str, balanced: bool):
            self.context, self.method, self.balanced = context, method, balanced
            strategy = px.ContextParallel(context, method=method, load_balance=balanced)
            if context < 8:
                strategy = px.combine(strategy, px.DataParallel(8 // context))
            super().__init__(length, strategy)

    def tiles(length: int, context: int, method: str) -> list[int]:
        """Per device, the tiles of scores one of the LM's attentions computes, balanced."""
        attention = nn.MultiHeadDotProductAttention(4)
        x = np.zeros((1, length, 64), np.float32)
        params = jax.eval_shape(attention.init, jax.random.key(0), x, x)
        params = jax.tree.map(lambda s: np.ones(s.shape, s.dtype), params)
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:context]), ("context",))
        return tiles_computed(lambda x: attention.apply(params, x, x, mask=nn.make_causal_mask(x[..., 0])), x,
                              mesh=mesh, axis="context", method=method).tolist()

    configs = CONFIGS[:1] if args.smoke else CONFIGS
    runners = [Runner(length, context, method, balanced) for length, context in configs for method in METHODS
               for balanced in (False, True)]
    time_interleaved(runners, args.rounds)
    results = []
    for off, on in zip(runners[::2], runners[1::2]):
        ratios = sorted(b / a for a, b in zip(off.times, on.times))
        for runner in (off, on):
            rates = sorted(runner.tokens / t for t in runner.times)
            results.append({
                "length": runner.length, "context": runner.context, "method": runner.method,
                "load_balance": runner.balanced,
                "strategy": runner.label, "tokens_per_s": [rates[0], float(np.median(rates)), rates[-1]],
                "peak": runner.peak, "moved": runner.moved,
                "tiles_per_device": tiles(runner.length, runner.context, runner.method) if runner.balanced
                else [4 * runner.context] * runner.context,
                "time_ratio": [ratios[0], float(np.median(ratios)), ratios[-1]] if runner.balanced else None})

    def markdown(rows, meta):
        lines = ["| tokens | strategy | tiles per device (of 4 × CP) | tokens/s (min / median / max) | "
                 "balanced ÷ unbalanced step (min / median / max) | peak per device | collectives per device |",
                 "| ---: | --- | --- | ---: | ---: | ---: | ---: |"]
        for r in rows:
            low, mid, high = r["tokens_per_s"]
            counts = sorted(set(r["tiles_per_device"]))
            ratio = "" if r["time_ratio"] is None else "{:.3f} / {:.3f} / {:.3f}".format(*r["time_ratio"])
            lines.append(f"| {r['length']} | {r['strategy']} | {'–'.join(map(str, counts))} of "
                         f"{4 * r['context']} | {low:,.0f} / {mid:,.0f} / {high:,.0f} | {ratio} | "
                         f"{r['peak'] / 2**20:.1f} MiB | {r['moved'] / 2**20:.2f} MiB |")
        return "\n".join(lines)

    report(args, "context_balance", results, markdown, batch=8)


if __name__ == "__main__":
    main()
