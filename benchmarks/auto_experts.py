"""What ``strategy="auto"`` picks for a mixture whose experts are a list, measured against the best
of each layout family it priced (``python -m benchmarks.auto_experts``).

``ListedSwitch`` (``benchmarks/models.py``: top-1 routing, a capacity of 1.25x per row of tokens,
one-hot dispatch, 8 experts each an ``Expert`` module of its own, width 128, expert hidden 512) on
16 rows of 32 tokens over 8 devices. The search runs as the Trainer runs it for a long run
(:func:`parallax.state.search.resolve` with ``steps=10**6``: every candidate priced by the cost
model, the closest few and each other layout family's best timed, the measured fastest kept past
a 10 % margin). Then the pick and the best-priced candidate of each family (data parallelism and
FSDP; tensor; expert) are timed again in interleaved rounds (each the mean of 3 steps) on the same
simulated devices. ``pick ÷`` is the pick's step time over the row's within each round (min /
median / max over rounds): below 1 the pick is faster. On 8 simulated devices sharing 2 CPU cores
a step's time is every device's work summed.
"""

from benchmarks import side_runner_args


def main() -> None:
    args = side_runner_args(__doc__, models="listed-switch", rounds=7)
    import jax
    import numpy as np
    import optax

    import parallax as px
    from benchmarks import TimedSteps, report, time_interleaved
    from benchmarks.models import ListedSwitch, lm_loss
    from parallax import inspect
    from parallax.parallel.candidates import candidates, expert_candidates, layout_family
    from parallax.state.search import resolve

    width, hidden = (32, 64) if args.smoke else (128, 512)
    batch = {"x": np.random.default_rng(0).integers(0, 64, (16, 33)).astype(np.int32)}
    adamw = optax.adamw(1e-3)
    found = resolve(ListedSwitch(width, hidden), adamw, batch, "auto", loss_fn=lm_loss, steps=10**6,
                    devices=jax.devices()[:8])
    print(found.describe())
    picked = found.strategy.describe(found.mesh)
    known = {strategy.describe(): strategy for strategy in
             [*candidates(8), *expert_candidates(8, 8, expert=px.ExpertParallel(modules="Expert"))]}
    best: dict = {}  # each family's best-priced candidate that fits, fastest first
    for label, estimate in found.choice.estimates.items():
        name, path = label.rsplit(", ", 1)
        if label not in found.choice.over_budget and name in known:
            best.setdefault(layout_family(known[name]), (name, path, estimate))

    class Runner(TimedSteps):
        def __init__(self, strategy, path):
            self.times, self.label = [], strategy.describe()
            self.state = px.init_state(ListedSwitch(width, hidden), adamw, batch, strategy=strategy, loss_fn=lm_loss)
            self.step = px.make_train_step(lm_loss, strategy, compile=path)
            compiled = self.step.lower(self.state, batch).compile()
            self.peak = inspect.peak_bytes(inspect.memory_bytes(compiled))
            self.moved = {kind: stat.bytes for kind, stat in inspect.collective_bytes(compiled.as_text()).items()}
            mesh = jax.tree.leaves(self.state.params)[0].sharding.mesh
            self.batch = jax.device_put(batch, jax.sharding.NamedSharding(mesh, strategy.batch_spec()))

    rows = [(picked, found.compile, found.choice.estimates[f"{picked}, {found.compile}"])]
    rows += [row for row in best.values() if row[0] != picked]
    runners = [Runner(found.strategy if name == picked else known[name], path) for name, path, _ in rows]
    time_interleaved(runners, args.rounds)
    pick, results = runners[0], []
    for runner, (name, path, estimate) in zip(runners, rows):
        ratios = sorted(a / b for a, b in zip(pick.times, runner.times))
        times = sorted(runner.times)
        results.append({"strategy": f"{name}, {path}", "picked": runner is pick, "estimate": estimate.seconds,
                        "timed_in_search": found.choice.timed.get(f"{name}, {path}"),
                        "seconds": [times[0], float(np.median(times)), times[-1]],
                        "pick_over": None if runner is pick else [ratios[0], float(np.median(ratios)), ratios[-1]],
                        "peak": runner.peak, "moved": sum(runner.moved.values())})

    def markdown(rows, meta):
        lines = [f"Search: {meta['search']}", "",
                 "| strategy | est. step | timed in the search | step ms (min / median / max) "
                 "| pick ÷ (min / median / max) | peak per device | collectives per device |",
                 "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in rows:
            low, mid, high = (1e3 * t for t in r["seconds"])
            over = "**picked**" if r["picked"] else " / ".join(f"{x:.2f}" for x in r["pick_over"])
            timed = "—" if r["timed_in_search"] is None else f"{1e3 * r['timed_in_search']:.1f} ms"
            lines.append(f"| {r['strategy']} | {1e3 * r['estimate']:.1f} ms | {timed} "
                         f"| {low:.1f} / {mid:.1f} / {high:.1f} | {over} | {r['peak'] / 2**20:.1f} MiB "
                         f"| {r['moved'] / 2**10:,.0f} KiB |")
        return "\n".join(lines)

    report(args, "auto_experts", results, markdown, batch=16, width=width, hidden=hidden, search=found.describe())


if __name__ == "__main__":
    main()
