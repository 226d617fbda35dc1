"""What planning finds, recorded so that a restructuring can be shown to change none of it.

    python -m benchmarks.plan_rows --out /tmp/before.json     # record (8 simulated CPU devices, ~30 min on 2 cores)
    python -m benchmarks.plan_rows --only lm,moe --sections plans --out /tmp/part.json   # some of it
    python -m benchmarks.plan_rows --compare /tmp/before.json /tmp/after.json

Recorded per case: ``px.plan``'s rows for every strategy kind (DP, FSDP, TP, their hybrids, PP over a scan and over
listed blocks, CP gathered, by ring and load-balanced, EP over stacked and listed experts) on linen, NNX and
Hugging Face models — each row's mesh, compile path, state bytes, compiled memory, peak and collective bytes by
kind (every figure the compiler decides, none timed); FSDP's split pick (``FSDP(split="auto")`` through
``px.init_state``'s search: each param's spec, its candidates priced and never timed: ``timed_candidates=0``); and
``"auto"``'s pick and runner-up on three models, predicted on a named accelerator (``hardware="h100"``) and
estimated by this machine's cost model. ``--compare`` prints every difference and exits 1 if there is one. The step
times the cost model estimates are recorded with the picks they decide but compared only through them: they read
this machine's measured speeds (``~/.cache/parallax``), the same before and after on one machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if __name__ == "__main__":
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Row figures the compiler decides; "step"/"seconds" are the cost model's, compared through the picks.
ROW_KEYS = ("strategy", "devices", "mesh", "compile", "state", "compiled", "peak", "collectives",
            "collective_bytes", "error")


def _models():
    import numpy as np
    import optax
    from flax import nnx

    from benchmarks.models import ListedSwitch, TransformerLM
    from tests import models as tm
    from tests import third_party

    class NnxLM(nnx.Module):
        def __init__(self, rngs: nnx.Rngs, vocab: int = 64, width: int = 32, heads: int = 4):
            self.embed = nnx.Embed(vocab, width, rngs=rngs)
            self.norm = nnx.LayerNorm(width, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(heads, width, decode=False, rngs=rngs)
            self.up = nnx.Linear(width, 4 * width, rngs=rngs)
            self.down = nnx.Linear(4 * width, width, rngs=rngs)
            self.head = nnx.Linear(width, vocab, rngs=rngs)

        def __call__(self, tokens):
            x = self.embed(tokens)
            h = self.norm(x)
            x = x + self.attn(h, mask=nnx.make_causal_mask(tokens))
            x = x + self.down(nnx.gelu(self.up(x)))
            return self.head(x)

    def nnx_loss(model, batch):
        logits = model(batch["x"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["x"][:, 1:]).mean()

    rng = np.random.default_rng(0)
    lm_batch = {"x": rng.integers(0, 64, (16, 17)).astype(np.int32)}
    long_batch = {"x": rng.integers(0, 64, (4, 129)).astype(np.int32)}
    from tests.test_expert_parallel import CapacityMoE, moe_loss
    return {
        "mlp": (tm.MLP(), tm.classifier_loss, tm.batches("mlp", 1)[0]),
        "cnn": (tm.CNN(), tm.classifier_loss, tm.batches("cnn", 1)[0]),
        "stacked_mlp": (tm.StackedMLP(layers=4), tm.classifier_loss, tm.batches("mlp", 1)[0]),
        "lm": (TransformerLM(vocab=64, features=32, layers=2, heads=4), tm.lm_loss, lm_batch),
        "lm_long": (tm.TinyLM(), tm.lm_loss, long_batch),
        "nnx_lm": (lambda: NnxLM(nnx.Rngs(0)), nnx_loss, lm_batch),
        "gpt2": (third_party.gpt2(layers=2), third_party.causal_lm_loss, third_party.batches("text", 1)[0]),
        "switch": (ListedSwitch(16, 32, 4), tm.lm_loss, lm_batch),
        "moe": (CapacityMoE(top_k=2, capacity_factor=1.25), moe_loss, lm_batch),
    }


def _cases(px):
    return {
        "mlp": ["dp", "fsdp", "tp", "fsdp+tp2", px.FSDP(min_weight_size=0, split="output"),
                px.combine(px.DataParallel(2), px.FSDP(4, min_weight_size=0))],
        "cnn": ["dp", px.FSDP(min_weight_size=0)],
        "stacked_mlp": [px.combine(px.PipelineParallel(2, microbatches=4), px.DataParallel(4)),
                        px.combine(px.PipelineParallel(2), px.FSDP(4, min_weight_size=0))],
        "lm": ["dp", px.FSDP(min_weight_size=0), "tp", "fsdp+tp2",
               px.combine(px.PipelineParallel(2, blocks="Block"), px.DataParallel(4))],
        "lm_long": [px.combine(px.ContextParallel(2), px.FSDP(4)), px.combine(px.ContextParallel(2, method="ring"),
                                                                              px.DataParallel(4)),
                    px.combine(px.ContextParallel(4, load_balance=True), px.DataParallel(2))],
        "nnx_lm": ["dp", px.FSDP(min_weight_size=0), "tp"],
        "gpt2": [px.FSDP(min_weight_size=0), "tp",
                 px.combine(px.PipelineParallel(2, blocks="FlaxGPT2Block"), px.DataParallel(4))],
        "switch": ["dp", px.combine(px.ExpertParallel(4, modules="Expert"), px.DataParallel(2)),
                   px.combine(px.ExpertParallel(2, modules="Expert"), px.FSDP(4, min_weight_size=0))],
        "moe": ["dp", px.ExpertParallel(8), px.combine(px.ExpertParallel(4), px.FSDP(2, min_weight_size=0))],
    }


def _row(row: dict) -> dict:
    return {key: row.get(key) for key in ROW_KEYS if key in row}


def _pick(pick) -> dict:
    return {"strategy": pick.strategy, "runner_up": pick.runner_up[0] if pick.runner_up else None,
            "seconds": pick.seconds, "basis": pick.basis, "fitting": pick.fitting, "planned": pick.planned,
            "pruned": pick.pruned}


def record(only: set[str] | None = None, out_path: str | None = None,
           sections: tuple[str, ...] = ("plans", "splits", "auto")) -> dict:
    import jax
    import optax

    import parallax as px

    out = {"jax": jax.__version__, "devices": jax.device_count(), "plans": {}, "splits": {}, "auto": {}}
    models = _models()
    for name, strategies in _cases(px).items():
        if (only and name not in only) or "plans" not in sections:
            continue
        model, loss_fn, batch = models[name]
        start = time.perf_counter()
        report = px.plan(model, optax.adamw(1e-3), batch, loss_fn=loss_fn, strategies=strategies, timed_candidates=0)
        out["plans"][name] = [_row(row) for row in report.rows]
        _save(out, out_path)
        print(f"plan {name}: {len(report.rows)} rows, {time.perf_counter() - start:.1f} s", flush=True)
    for name in ("mlp", "lm", "nnx_lm", "cnn"):
        if (only and name not in only) or "splits" not in sections:
            continue
        model, loss_fn, batch = models[name]
        start = time.perf_counter()
        state = px.init_state(model, optax.adamw(1e-3), batch, strategy=px.FSDP(min_weight_size=0), loss_fn=loss_fn,
                              options=px.StepOptions(timed_candidates=0, search_seconds=600))
        out["splits"][name] = _specs(state)
        _save(out, out_path)
        print(f"split {name}: {time.perf_counter() - start:.1f} s", flush=True)
    for name in ("lm", "nnx_lm", "switch"):
        if (only and name not in only) or "auto" not in sections:
            continue
        model, loss_fn, batch = models[name]
        start = time.perf_counter()
        picks = {}
        for hardware in ("h100", None):
            report = px.plan(model, optax.adamw(1e-3), batch, loss_fn=loss_fn, strategies=["auto"], hardware=hardware,
                             timed_candidates=0, search_seconds=600)
            picks[hardware or "here"] = {"picks": [_pick(p) for p in report.picks],
                                         "rows": [_row(r) for r in report.rows]}
        out["auto"][name] = picks
        _save(out, out_path)
        print(f"auto {name}: {[p['picks'][0]['strategy'] for p in picks.values()]}, "
              f"{time.perf_counter() - start:.1f} s", flush=True)
    return out


def _save(out: dict, path: str | None) -> None:
    """The record so far (a long run leaves what it has recorded if it is stopped)."""
    if path:
        with open(path, "w") as f:
            f.write(json.dumps(out, indent=1, sort_keys=True, default=str))


def _specs(state) -> dict:
    import jax

    flat = jax.tree_util.tree_flatten_with_path(state.params)[0]
    return {jax.tree_util.keystr(path): str(getattr(leaf.sharding, "spec", None)) for path, leaf in flat}


def compare(before: dict, after: dict) -> list[str]:
    """Every difference, except the cost model's seconds (compared through the picks they decide)."""
    diffs = []

    def walk(a, b, where):
        if isinstance(a, dict) and isinstance(b, dict):
            for key in sorted(set(a) | set(b), key=str):
                if key == "seconds" or key == "jax":
                    continue
                if key not in a or key not in b:
                    diffs.append(f"{where}.{key}: only {'after' if key in b else 'before'}")
                else:
                    walk(a[key], b[key], f"{where}.{key}")
        elif isinstance(a, list) and isinstance(b, list):
            if len(a) != len(b):
                diffs.append(f"{where}: {len(a)} entries before, {len(b)} after")
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{where}[{i}]")
        elif a != b:
            diffs.append(f"{where}: {a!r} before, {b!r} after")

    walk(before, after, "")
    return diffs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write the record here (JSON)")
    parser.add_argument("--only", help="comma-separated model names")
    parser.add_argument("--sections", default="plans,splits,auto", help="of plans, splits, auto")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    if args.compare:
        with open(args.compare[0]) as a, open(args.compare[1]) as b:
            diffs = compare(json.load(a), json.load(b))
        print("\n".join(diffs) if diffs else "identical: every row, split and pick")
        return 1 if diffs else 0
    result = record(set(args.only.split(",")) if args.only else None, args.out, tuple(args.sections.split(",")))
    if not args.out:
        print(json.dumps(result, indent=1, sort_keys=True, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
