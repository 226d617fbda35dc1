"""A softmax's attention in one pass over its tiles against a pass per reduction, round a ring and
load-balanced (``python -m benchmarks.one_pass``).

The causal LM of ``benchmarks/context_speed.py`` (``TransformerLM``: 2 blocks of linen's
``nn.MultiHeadDotProductAttention`` with ``nn.make_causal_mask``, width 64, 4 heads) trains on a batch
of 8 sequences over 8 devices under ``ContextParallel(8)`` by the ring and load-balanced (gathered
and round the ring). Each is compiled twice in this process: as parallax runs it (its softmax's
weights in one pass over the tiles: ``parallax.parallel.context.tiles``) and with that form turned
off for its compile (a pass over the tiles for the maximum, one for the sum, one for the weights
times the values: what ran before). Step times in interleaved rounds (each the mean of 3 steps);
``one pass ÷ passes`` is the ratio of the two step times within each round (min / median / max over
rounds). Per device: the compiled step's FLOPs (each loop's turns counted), the bytes its
collectives move and its peak. On 8 simulated devices sharing 2 CPU cores every device's work runs
on the same cores: the times say what the work saved is worth, not what a GPU would gain.
"""

from benchmarks import side_runner_args

LENGTHS = (1024, 2048)
METHODS = (("ring", False), ("all_gather", True), ("ring", True))  # (method, load_balance)


def main() -> None:
    args = side_runner_args(__doc__, models="lm", rounds=5)
    import contextlib

    import numpy as np

    import parallax as px
    from benchmarks import report, time_interleaved
    from benchmarks.context_speed import LMSteps
    from parallax.parallel.context import balanced as balanced_attention
    from parallax.parallel.context import ring as ring_attention

    @contextlib.contextmanager
    def passes():
        """The one-pass form turned off while a step compiles (a pass per reduction, as before it)."""
        saved = ring_attention.find, balanced_attention.find
        ring_attention.find = balanced_attention.find = lambda tiles: None
        try:
            yield
        finally:
            ring_attention.find, balanced_attention.find = saved

    class Runner(LMSteps):
        def __init__(self, length: int, method: str, balanced: bool, one_pass: bool):
            self.method, self.balanced, self.one_pass = method, balanced, one_pass
            with contextlib.nullcontext() if one_pass else passes():
                super().__init__(length, px.ContextParallel(8, method=method, load_balance=balanced), flops=True)

    lengths = LENGTHS[:1] if args.smoke else LENGTHS
    runners = [Runner(length, method, balanced, one_pass) for length in lengths for method, balanced in METHODS
               for one_pass in (True, False)]
    time_interleaved(runners, args.rounds)
    results = []
    for one, several in zip(runners[::2], runners[1::2]):
        ratios = sorted(a / b for a, b in zip(one.times, several.times))
        for runner in (one, several):
            rates = sorted(runner.tokens / t for t in runner.times)
            results.append({"length": runner.length, "strategy": runner.label, "one_pass": runner.one_pass,
                            "tokens_per_s": [rates[0], float(np.median(rates)), rates[-1]],
                            "one_over_passes": [ratios[0], float(np.median(ratios)), ratios[-1]]
                            if runner.one_pass else None,
                            "flops": runner.flops, "moved": runner.moved, "peak": runner.peak})

    def markdown(rows, meta):
        lines = ["| tokens | strategy | softmax | tokens/s (min / median / max) | one pass ÷ passes (min / median / "
                 "max) | GFLOP per device | collectives per device | peak per device |",
                 "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
        for r in rows:
            low, mid, high = r["tokens_per_s"]
            ratio = " / ".join(f"{x:.2f}" for x in r["one_over_passes"]) if r["one_pass"] else ""
            lines.append(f"| {r['length']} | {r['strategy']} | {'one pass' if r['one_pass'] else 'a pass each'} | "
                         f"{low:,.0f} / {mid:,.0f} / {high:,.0f} | {ratio} | {r['flops'] / 1e9:.2f} | "
                         f"{r['moved'] / 2**20:.2f} MiB | {r['peak'] / 2**20:.1f} MiB |")
        return "\n".join(lines)

    report(args, "one_pass", results, markdown, batch=8)


if __name__ == "__main__":
    main()
