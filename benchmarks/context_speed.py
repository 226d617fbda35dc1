"""Tokens per second and per-device peak under ContextParallel against sequence length
(``python -m benchmarks.context_speed``).

The causal LM of ``benchmarks/context_memory.py`` (2 blocks of linen's
``nn.MultiHeadDotProductAttention``, width 64) trains on a batch of 8 sequences on the 8 devices
under ``DataParallel(8)`` (one sequence per device), ``ContextParallel(2) × DataParallel(4)``,
``ContextParallel(4) × DataParallel(2)`` and ``ContextParallel(8)`` (one sequence over all
devices), at several sequence lengths. Step times are measured in interleaved rounds (each a mean
of 3 steps); the table gives tokens/s (median over rounds, with min and max), the per-device peak
of the compiled step (``memory_analysis()``) and the bytes its collectives move per device (from
its HLO). On 8 simulated devices sharing 2 CPU cores the times say what the extra work and data
movement of context parallelism cost, not what a GPU would gain.
"""

from benchmarks import side_runner_args

LENGTHS = (256, 512, 1024)
CONTEXT = (1, 2, 4, 8)


def main() -> None:
    args = side_runner_args(__doc__, models="lm", rounds=5)
    import time

    import flax.linen as nn
    import jax
    import numpy as np
    import optax

    import parallax as px
    from benchmarks import report, time_interleaved
    from parallax import inspect

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.LayerNorm()(x)
            x = x + nn.MultiHeadDotProductAttention(4)(h, h, mask=nn.make_causal_mask(x[..., 0]))
            return x + nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(4 * x.shape[-1])(nn.LayerNorm()(x))))

    class LM(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(256, 64)(tokens)
            for _ in range(2):
                x = Block()(x)
            return nn.Dense(256)(nn.LayerNorm()(x))

    def loss_fn(model, batch):
        logits = model(batch["tokens"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()

    class Runner:
        def __init__(self, length: int, context: int):
            self.length, self.context, self.times = length, context, []
            rows = 8
            batch = {"tokens": np.random.default_rng(0).integers(0, 256, (rows, length + 1)).astype(np.int32)}
            parts = [px.ContextParallel(context)] if context > 1 else []
            if context < 8:
                parts.append(px.DataParallel(8 // context))
            strategy = parts[0] if len(parts) == 1 else px.combine(*parts)
            self.label = strategy.describe()
            self.state = px.init_state(LM(), optax.adamw(1e-3), batch, strategy=strategy, loss_fn=loss_fn)
            self.step = px.make_train_step(loss_fn, strategy, compile="jit")
            compiled = self.step.lower(self.state, batch).compile()
            self.peak = inspect.peak_bytes(inspect.memory_bytes(compiled))
            self.moved = sum(stat.bytes for stat in inspect.collective_bytes(compiled.as_text()).values())
            self.batch, self.tokens = batch, rows * length
            self.state, metrics = self.step(self.state, self.batch)
            jax.block_until_ready(metrics)

        def run(self) -> float:
            start = time.perf_counter()
            for _ in range(3):
                self.state, metrics = self.step(self.state, self.batch)
            jax.block_until_ready(metrics)
            return (time.perf_counter() - start) / 3

    lengths = LENGTHS[:1] if args.smoke else LENGTHS
    runners = [Runner(length, context) for length in lengths for context in CONTEXT]
    time_interleaved(runners, args.rounds)
    results = []
    for runner in runners:
        rates = sorted(runner.tokens / t for t in runner.times)
        results.append({"length": runner.length, "context": runner.context, "strategy": runner.label,
                        "tokens_per_s": [rates[0], float(np.median(rates)), rates[-1]], "peak": runner.peak,
                        "moved": runner.moved})

    def markdown(rows, meta):
        lines = ["| tokens | strategy | tokens/s (min / median / max) | peak per device | collectives per device |",
                 "| ---: | --- | ---: | ---: | ---: |"]
        for r in rows:
            low, mid, high = r["tokens_per_s"]
            lines.append(f"| {r['length']} | {r['strategy']} | {low:,.0f} / {mid:,.0f} / {high:,.0f} | "
                         f"{r['peak'] / 2**20:.1f} MiB | {r['moved'] / 2**20:.2f} MiB |")
        return "\n".join(lines)

    report(args, "context_speed", results, markdown, batch=8)


if __name__ == "__main__":
    main()
