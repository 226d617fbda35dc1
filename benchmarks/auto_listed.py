"""What ``strategy="auto"`` picks for a model whose blocks are a list, over hosts joined by a slow link
(``python -m benchmarks.auto_listed``).

Hugging Face's Flax GPT-2 as the ``transformers`` package builds it (``FlaxGPT2LMHeadModule``: its 4
blocks a list of ``FlaxGPT2Block``), GPT-2 small's width (768, 12 heads), a vocabulary of 512, 16
rows of 128 tokens, AdamW, planned for 2 hosts of 4 H100s joined at 10 Gb/s a device
(``px.Hardware("h100", devices_per_host=4, inter_host_gbps=10)``) by ``px.plan(strategies=
["auto"], hardware=...)``: XLA's GPU compiler without the GPUs, each candidate's step predicted on
them (compute, memory and the collectives on the links their devices span). Beside them, the
pipeline with the blocks kept as the model writes them (``stack_blocks=False``: restacked every
step). Then the pick, and the same pipeline restacking its blocks, train against a plain one-device
optax loop for 2 steps on this machine's simulated devices, with AdamW and with SGD
(``px.testing.assert_equivalent``; its report's first line either way).
"""

from benchmarks import side_runner_args


def main() -> None:
    args = side_runner_args(__doc__, models="gpt2", rounds=1)
    import ast

    import numpy as np
    import optax
    import transformers

    import parallax as px
    from benchmarks import report
    from tests.third_party import causal_lm_loss

    width, heads = (64, 4) if args.smoke else (768, 12)
    config = transformers.GPT2Config(vocab_size=512, n_positions=128, n_embd=width, n_layer=4, n_head=heads,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.models.gpt2.modeling_flax_gpt2.FlaxGPT2LMHeadModule(config)
    tokens = np.random.default_rng(0).integers(1, 512, (16, 129)).astype(np.int32)
    batch = {"tokens": tokens, "mask": np.ones_like(tokens, bool)}
    hardware = px.Hardware("h100", devices_per_host=4, inter_host_gbps=10)
    restacked = px.combine(px.PipelineParallel(2, blocks="FlaxGPT2Block", stack_blocks=False), px.DataParallel(4))
    plan = px.plan(model, optax.adamw(1e-3), batch, loss_fn=causal_lm_loss, strategies=["auto", restacked],
                   hardware=hardware, devices=8)
    (picked,) = plan.picks
    print(picked.describe())
    rows = []
    for row in sorted((r for r in plan.rows if not r.get("error") and r.get("step")),
                      key=lambda r: r["step"]["seconds"]):
        rows.append({"strategy": row["strategy"], "seconds": row["step"]["seconds"], "peak": row["peak"],
                     "across": (row.get("links") or {}).get("across"), "inside": (row.get("links") or {}).get("inside"),
                     "picked": row["strategy"] == picked.strategy})
    parts = []  # the pick, from its row's label: "PipelineParallel(stage=2, blocks='...') × DataParallel(data=4)"
    for part in picked.strategy.split(" × "):
        name, inside = part[:-1].split("(", 1)
        fields = [item.split("=", 1) for item in inside.split(", ")]
        parts.append(getattr(px, name)(int(fields[0][1]), **{k: ast.literal_eval(v) for k, v in fields[1:]}))
    batches = [{"tokens": t, "mask": np.ones_like(t, bool)}
               for t in np.random.default_rng(1).integers(1, 512, (2, 16, 129)).astype(np.int32)]
    equivalence = []  # the pick and the same pipeline restacking its blocks, each optimizer
    for name, tx in (("AdamW", optax.adamw(1e-3)), ("SGD", optax.sgd(0.1))):
        for strategy in (px.combine(*parts), restacked):
            try:
                line = str(px.testing.assert_equivalent(model, tx, causal_lm_loss, batches, strategy))
            except px.testing.NotEquivalentError as err:
                line = str(err)
            equivalence.append(f"{name}, {line.splitlines()[0].removeprefix('parallax.testing: ')}")
            print(equivalence[-1])

    def markdown(rows, meta):
        fastest = min(r["seconds"] for r in rows)
        lines = [f"Pick: {meta['pick']}", "", "Against a plain one-device optax loop, 2 steps:", "",
                 *[f"- {line}" for line in meta["equivalence"]], "",
                 "| strategy | predicted step | ÷ pick | peak per device | across hosts per device | inside a host |",
                 "| --- | ---: | ---: | ---: | ---: | ---: |"]
        for r in rows:
            name = f"**{r['strategy']}** (picked)" if r["picked"] else r["strategy"]
            lines.append(f"| {name} | {1e3 * r['seconds']:.2f} ms | {r['seconds'] / fastest:.2f} | "
                         f"{r['peak'] / 2**20:.1f} MiB | {(r['across'] or 0) / 2**20:.1f} MiB | "
                         f"{(r['inside'] or 0) / 2**20:.1f} MiB |")
        return "\n".join(lines)

    report(args, "auto_listed", rows, markdown, width=width, hardware="h100, 4 a host, 10 Gb/s between",
           pick=picked.describe(), equivalence=equivalence)


if __name__ == "__main__":
    main()
