"""Per-device memory against sequence length under ContextParallel (``python -m benchmarks.context_memory``).

A causal transformer LM (``benchmarks/models.py``'s ``TransformerLM``: 2 blocks of linen's
``nn.MultiHeadDotProductAttention``, width 64, 4 heads) on a batch of 2 sequences, planned by
``px.plan`` (compiled, nothing allocated) for each sequence length under ``ContextParallel(c)`` on
``c`` devices (``c = 1``: one device, no context axis), by each method (``all_gather``: every
device gathers the keys and values and computes its queries' rows of the scores; ``ring``: one
block of keys at a time). It prints each compiled step's per-device peak (arguments + outputs - donated + temps,
from ``memory_analysis()``: exact), the peak times ``c`` over one device's (1.0 where memory falls
exactly as 1/CP), and the longest of the lengths whose step fits a per-device budget
(``--budget``, bytes) at each context size.
"""

from benchmarks import side_runner_args

LENGTHS = (256, 512, 1024, 2048, 4096, 8192)
SIZES = (1, 2, 4, 8)
METHODS = ("all_gather", "ring")


def main() -> None:
    args = side_runner_args(__doc__, models="lm", rounds=1, budget="40000000")
    import jax
    import jax.numpy as jnp
    import optax

    import parallax as px
    from benchmarks import report
    from benchmarks.models import TransformerLM, lm_loss

    lengths = LENGTHS[:2] if args.smoke else LENGTHS
    results = []
    for length in lengths:
        batch = {"x": jax.ShapeDtypeStruct((2, length + 1), jnp.int32)}
        for size, method in [(1, "")] + [(size, method) for size in SIZES[1:] for method in METHODS]:
            lm = TransformerLM(vocab=256, features=64, layers=2, heads=4)
            strategy = px.DataParallel() if size == 1 else px.ContextParallel(size, method=method)
            row = px.plan(lm, optax.adamw(1e-3), batch, loss_fn=lm_loss, strategies=[strategy], devices=[size]).rows[0]
            results.append({"length": length, "context": size, "method": method, "peak": int(row["peak"])})
    budget = int(args.budget)

    def markdown(rows, meta):
        one = {r["length"]: r["peak"] for r in rows if r["context"] == 1}
        lines = ["| tokens | CP | method | peak per device | peak × CP ÷ one device's |",
                 "| ---: | ---: | --- | ---: | ---: |"]
        lines += [f"| {r['length']} | {r['context']} | {r.get('method', '')} | {r['peak'] / 2**20:.1f} MiB | "
                  f"{r['peak'] * r['context'] / one[r['length']]:.3f} |" for r in rows]
        lines += ["", f"Longest of these sequences whose step fits {meta['budget'] / 2**20:.1f} MiB per device:", ""]
        for size, method in dict.fromkeys((r["context"], r.get("method", "")) for r in rows):
            fits = [r["length"] for r in rows
                    if r["context"] == size and r.get("method", "") == method and r["peak"] <= meta["budget"]]
            lines.append(f"- CP {size}{' ' + method if method else ''}: {max(fits) if fits else 'none'}")
        return "\n".join(lines)

    report(args, "context_memory", results, markdown, budget=budget, batch=2)


if __name__ == "__main__":
    main()
