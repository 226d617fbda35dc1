"""Step time and bytes moved of ExpertParallel against FSDP and TP on mixtures of experts
(``python -m benchmarks.expert_speed``).

Two mixtures of 8 experts at two sizes each, on a batch of 16 rows of 32 tokens over the 8
devices: the zoo's MoE (``benchmarks/zoo_models.py``: every expert runs on every token, the outputs
gated: a dense dispatch) and a Switch-style MoE (top-1 routing, a capacity of 1.25x per group of
tokens, tokens dispatched to ``[experts, ...]`` weights with a one-hot mask). Each trains under
``DataParallel(8)``, ``FSDP(8)`` (every param split), ``TensorParallel(8)``, ``ExpertParallel(8)``
and ``ExpertParallel(4) × FSDP(2)``, in interleaved rounds (each a mean of 3 steps). The table
gives the step time (median over rounds, with min and max), the params per device, the compiled
step's per-device peak (``memory_analysis()``) and the bytes its collectives move per device by
kind (from its HLO: all-gather, all-reduce, reduce-scatter, all-to-all). On 8 simulated devices
sharing 2 CPU cores the times say what the data movement and the extra work cost, not what a GPU
would gain; the bytes are exact.
"""

from benchmarks import side_runner_args

EXPERTS = 8
SIZES = ((64, 128), (128, 512))  # (width, expert hidden)
STRATEGIES = ("dp", "fsdp", "tp", "ep", "ep4+fsdp2")


def main() -> None:
    args = side_runner_args(__doc__, models="moe", rounds=5)
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import parallax as px
    from benchmarks import TimedSteps, report, time_interleaved
    from benchmarks.zoo_models import MoE
    from parallax import inspect

    class SwitchMoE(nn.Module):
        """Top-1 routing with a capacity per group (a row of tokens), one-hot dispatch, stacked experts."""

        width: int
        hidden: int

        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(256, self.width)(tokens)
            h = nn.LayerNorm()(x)
            probs = jax.nn.softmax(nn.Dense(EXPERTS, use_bias=False, name="router")(h))
            capacity = int(1.25 * h.shape[1] / EXPERTS)
            chosen = jax.nn.one_hot(jnp.argmax(probs, -1), EXPERTS)
            slot = (jnp.cumsum(chosen, axis=1) - 1) * chosen
            combine = (probs * chosen * (slot < capacity))[..., None] * jax.nn.one_hot(slot, capacity)
            init = nn.initializers.lecun_normal(batch_axis=(0,))
            w_in = self.param("w_in", init, (EXPERTS, self.width, self.hidden))
            w_out = self.param("w_out", init, (EXPERTS, self.hidden, self.width))
            dispatched = jnp.einsum("gtec,gtd->egcd", (combine > 0).astype(h.dtype), h)
            out = jnp.einsum("egch,ehd->egcd", nn.gelu(jnp.einsum("egcd,edh->egch", dispatched, w_in)), w_out)
            return nn.Dense(256, name="head")(nn.LayerNorm()(x + jnp.einsum("egcd,gtec->gtd", out, combine)))

    def loss_fn(model, batch):
        logits = model(batch["x"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["x"][:, 1:]).mean()

    def strategy_for(name: str):
        return {"dp": px.DataParallel(8), "fsdp": px.FSDP(8, min_weight_size=0), "tp": px.TensorParallel(8),
                "ep": px.ExpertParallel(8),
                "ep4+fsdp2": px.combine(px.ExpertParallel(4), px.FSDP(2, min_weight_size=0))}[name]

    class Runner(TimedSteps):
        def __init__(self, kind: str, width: int, hidden: int, name: str):
            self.kind, self.width, self.hidden, self.times = kind, width, hidden, []
            batch = {"x": np.random.default_rng(0).integers(0, 256, (16, 33)).astype(np.int32)}
            model = MoE(256, width, hidden, EXPERTS) if kind == "zoo" else SwitchMoE(width, hidden)
            strategy = strategy_for(name)
            self.label = strategy.describe()
            self.state = px.init_state(model, optax.adamw(1e-3), batch, strategy=strategy, loss_fn=loss_fn)
            self.step = px.make_train_step(loss_fn, strategy, compile="jit")
            compiled = self.step.lower(self.state, batch).compile()
            self.peak = inspect.peak_bytes(inspect.memory_bytes(compiled))
            self.moved = {kind: stat.bytes for kind, stat in inspect.collective_bytes(compiled.as_text()).items()}
            self.params = sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(self.state.params))
            mesh = strategy.make_mesh()
            self.batch = jax.device_put(batch, jax.sharding.NamedSharding(mesh, strategy.batch_spec()))
            self.state, metrics = self.step(self.state, self.batch)
            jax.block_until_ready(metrics)

    sizes = SIZES[:1] if args.smoke else SIZES
    runners = [Runner(kind, width, hidden, name) for kind in ("zoo", "switch") for width, hidden in sizes
               for name in STRATEGIES]
    time_interleaved(runners, args.rounds)
    results = []
    for runner in runners:
        times = sorted(runner.times)
        results.append({"model": runner.kind, "width": runner.width, "hidden": runner.hidden, "strategy": runner.label,
                        "seconds": [times[0], float(np.median(times)), times[-1]], "params": runner.params,
                        "peak": runner.peak, "moved": runner.moved})

    def markdown(rows, meta):
        kinds = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all")
        lines = ["| model | width / hidden | strategy | step ms (min / median / max) | params per device | peak | "
                 + " | ".join(kinds) + " |", "| --- | ---: | --- | ---: | ---: | ---: |" + " ---: |" * len(kinds)]
        for r in rows:
            low, mid, high = (1e3 * t for t in r["seconds"])
            moved = " | ".join(f"{r['moved'].get(kind, 0) / 2**10:,.0f} KiB" for kind in kinds)
            lines.append(f"| {r['model']} | {r['width']} / {r['hidden']} | {r['strategy']} | {low:.1f} / {mid:.1f} / "
                         f"{high:.1f} | {r['params'] / 2**10:,.0f} KiB | {r['peak'] / 2**20:.1f} MiB | {moved} |")
        return "\n".join(lines)

    report(args, "expert_speed", results, markdown, batch=16, experts=EXPERTS)


if __name__ == "__main__":
    main()
