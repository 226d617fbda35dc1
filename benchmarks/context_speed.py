"""Tokens per second and per-device peak under ContextParallel against sequence length
(``python -m benchmarks.context_speed``).

The causal LM of ``benchmarks/context_memory.py`` (``benchmarks/models.py``'s ``TransformerLM``: 2
blocks of linen's ``nn.MultiHeadDotProductAttention``, width 64, 4 heads) trains on a batch of 8
sequences on the 8 devices
under ``DataParallel(8)`` (one sequence per device), ``ContextParallel(2) × DataParallel(4)``,
``ContextParallel(4) × DataParallel(2)`` and ``ContextParallel(8)`` (one sequence over all
devices), each context axis by both methods (``all_gather``: keys and values gathered whole;
``ring``: passed round the axis a block at a time), at several sequence lengths. Step times are
measured in interleaved rounds (each a mean of 3 steps); the table gives tokens/s (median over rounds,
with min and max), the per-device peak of the compiled step (``memory_analysis()``), the bytes its
collectives move per device (from its HLO) and the FLOPs each device runs (``cost_analysis()`` with each
loop's turns after its first added: the step is one program that every device runs, so every device of
the axis runs these). On 8 simulated devices sharing 2 CPU cores the times say what the extra work and
data movement of context parallelism cost, not what a GPU would gain.
"""

from benchmarks import TimedSteps, side_runner_args

LENGTHS = (256, 512, 1024)
CONTEXT = (1, 2, 4, 8)
METHODS = ("all_gather", "ring")


class LMSteps(TimedSteps):
    """The causal LM of ``benchmarks/context_memory.py`` (``TransformerLM``, width 64, 2 blocks, 4 heads)
    on ``rows`` (8) sequences of ``length`` tokens under ``strategy``, compiled, placed and stepped once: its
    label, per-device peak, collective bytes (and ``flops``: the compiled FLOPs per device, each
    loop's turns counted), for :func:`~benchmarks.time_interleaved`."""

    def __init__(self, length: int, strategy, flops: bool = False, rows: int = 8):
        import jax
        import numpy as np
        import optax

        import parallax as px
        from benchmarks.models import TransformerLM, lm_loss
        from parallax import inspect

        self.length, self.times = length, []
        batch = {"x": np.random.default_rng(0).integers(0, 256, (rows, length + 1)).astype(np.int32)}
        self.label = strategy.describe()
        model = TransformerLM(vocab=256, features=64, layers=2, heads=4)
        self.state = px.init_state(model, optax.adamw(1e-3), batch, strategy=strategy, loss_fn=lm_loss)
        self.step = px.make_train_step(lm_loss, strategy, compile="jit")
        compiled = self.step.lower(self.state, batch).compile()
        self.peak = inspect.peak_bytes(inspect.memory_bytes(compiled))
        self.moved = sum(stat.bytes for stat in inspect.collective_bytes(compiled.as_text()).values())
        if flops:
            cost = compiled.cost_analysis()  # per device, each loop's body counted once: its other turns added
            cost = cost[0] if isinstance(cost, list) else cost
            self.flops = float(cost["flops"]) + inspect.loop_dot_flops(compiled.as_text())
        mesh = strategy.make_mesh()  # the batch on the devices once, not copied from the host at every step
        self.batch = jax.device_put(batch, jax.sharding.NamedSharding(mesh, strategy.batch_spec()))
        self.tokens = rows * length
        self.state, metrics = self.step(self.state, self.batch)
        jax.block_until_ready(metrics)


def main() -> None:
    args = side_runner_args(__doc__, models="lm", rounds=5)
    import numpy as np

    import parallax as px
    from benchmarks import report, time_interleaved

    class Runner(LMSteps):
        def __init__(self, length: int, context: int, method: str):
            self.context, self.method = context, method
            parts = [px.ContextParallel(context, method=method)] if context > 1 else []
            if context < 8:
                parts.append(px.DataParallel(8 // context))
            super().__init__(length, parts[0] if len(parts) == 1 else px.combine(*parts), flops=True)

    lengths = LENGTHS[:1] if args.smoke else LENGTHS
    runners = [Runner(length, context, method) for length in lengths for context in CONTEXT
               for method in (METHODS if context > 1 else METHODS[:1])]
    time_interleaved(runners, args.rounds)
    results = []
    for runner in runners:
        rates = sorted(runner.tokens / t for t in runner.times)
        results.append({"length": runner.length, "context": runner.context, "method": runner.method,
                        "strategy": runner.label,
                        "tokens_per_s": [rates[0], float(np.median(rates)), rates[-1]], "peak": runner.peak,
                        "moved": runner.moved, "flops": runner.flops})

    def markdown(rows, meta):
        lines = ["| tokens | strategy | method | tokens/s (min / median / max) | peak per device "
                 "| collectives per device | GFLOP per device |", "| ---: | --- | --- | ---: | ---: | ---: | ---: |"]
        for r in rows:
            low, mid, high = r["tokens_per_s"]
            method = r["method"] if r["context"] > 1 else ""
            lines.append(f"| {r['length']} | {r['strategy']} | {method} | {low:,.0f} / {mid:,.0f} / {high:,.0f} | "
                         f"{r['peak'] / 2**20:.1f} MiB | {r['moved'] / 2**20:.2f} MiB | "
                         f"{r.get('flops', 0) / 1e9:.2f} |")
        return "\n".join(lines)

    report(args, "context_speed", results, markdown, batch=8)


if __name__ == "__main__":
    main()
