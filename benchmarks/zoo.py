"""The zoo: does each default hold on models it was never tuned on?

    python -m benchmarks.zoo                         # 24 models x 5 kinds, 8 simulated CPU devices (~90 min)
    python -m benchmarks.zoo --models mlp_square_a,lm_0 --kinds fsdp --rounds 25
    python -m benchmarks.zoo --smoke                 # tiny widths, one round: checks it still runs

For each zoo member (``benchmarks/zoo_models.py``, drawn from ``--seed``) and each kind (DP,
FSDP, TP, DP×FSDP 2×4, FSDP×TP 4×2), every parallax configuration of that kind is compiled:
both compile paths (``jit``, ``shard_map``) and, where FSDP is part of it, every split
(``largest``, ``output``, ``input``). The **default** is what a user gets by writing the kind
with no options (``px.FSDP(min_weight_size=2**14)``: the zoo's models are small, so the split
threshold is scaled down as in every benchmark here), built as ``Trainer(max_steps=1000)``
builds it: where FSDP is part of the kind, its default ``split="auto"`` prices the splits (the
search bounded by what 1,000 steps could win) and trains the pick on the path it was priced
on; beside it, what the fixed ``split="largest"`` would train, the search's time beside
what it saves over 1,000 steps, and the default of the pieces under the Trainer
(``px.init_state`` + ``px.make_train_step`` with no ``steps=``: the split search bounded by
``search_seconds``, the step picking its own path). After its first call each is identified with the
configuration that has the same layout and path; splits that lay the params out alike are one
configuration. Peers, where installed (``make bench-peers``)
and where they express the same plan: google-parallax's DDP and FSDP on the NNX members,
Keras 3's ``DataParallel`` and its FSDP-like ``ModelParallel`` layout on the MLP stacks.

All configurations of one model are timed in the same rounds, in a new random order each
round; a round times one step of each, so it takes 25 rounds (the default) for a median that a
shared machine's noise does not move by more than a few percent (with 5, single steps 30% off
decided peers' medians). Reported per model and kind: ``default_over_best``, the default's step time over the
fastest parallax configuration's (by median), round by round, min/median/max; each peer's step
time over the default's. With ``--search``: ``strategy="auto"``'s search time beside the step
time its pick saves over 1,000 steps against the DP default. Output:
``results/zoo.{json,md,png}``.
"""

from __future__ import annotations

import os
import sys
import time

from benchmarks import report, side_runner_args, time_interleaved

KINDS = ("dp", "fsdp", "tp", "dp+fsdp", "fsdp+tp")
if __name__ == "__main__":
    ARGS = side_runner_args(__doc__, models="all", kinds=",".join(KINDS), rounds=25, seed="0",
                            search_models="mlp_square_a,mlp_megatron,lm_0,lm_scan,nnx_lm_1,cnn_0,moe",
                            switches=("no-peers", "no-search"))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import parallax as px  # noqa: E402
from benchmarks.run import MB, MIN_WEIGHT_SIZE, Config, round_ratios  # noqa: E402
from benchmarks.zoo_models import Member, zoo  # noqa: E402

SPLITS = ("largest", "output", "input")
STEPS = 1000  # the run the default's search is bounded by (what it could win back)
MODES = ("jit", "shard_map")


def strategy_of(kind: str, split: str | None = None) -> px.Strategy:
    """The strategy of ``kind`` on 8 devices; ``split=None`` leaves FSDP's split at its default."""
    extra = {} if split is None else {"split": split}
    fsdp = lambda size=-1: px.FSDP(size, min_weight_size=MIN_WEIGHT_SIZE, **extra)
    return {"dp": lambda: px.DataParallel(), "fsdp": lambda: fsdp(), "tp": lambda: px.TensorParallel(),
            "dp+fsdp": lambda: px.combine(px.DataParallel(2), fsdp(-1)),
            "fsdp+tp": lambda: px.combine(fsdp(-1), px.TensorParallel(2))}[kind]()


def configurations(kind: str) -> list[tuple[str, str | None, str]]:
    """``(label, split, compile)`` of every parallax configuration of ``kind``."""
    splits = SPLITS if "fsdp" in kind else (None,)
    return [(f"{split}/{mode}" if split else mode, split, mode) for split in splits for mode in MODES]


def specs_of(state) -> list:
    return [leaf.sharding.spec for leaf in jax.tree.leaves(state.params)]


class Default:
    """The kind's default as a user's ``Trainer(max_steps=1000)`` builds it (FSDP's default
    ``split="auto"``: the cost model's pick of the split, its search bounded by 1,000 steps,
    trained on the path it was priced on), or with a fixed ``split``; with ``pieces``, as
    ``px.init_state`` + ``px.make_train_step`` build it with no ``steps=`` (the run's length
    unknown: the split search bounded by ``search_seconds``, the step picking its own path)."""

    def __init__(self, member: Member, kind: str, tx, split: str | None = None, pieces: bool = False):
        from parallax.state.search import resolve

        start = time.perf_counter()
        if pieces:
            state = px.init_state(member.build(), tx, member.batch, strategy=strategy_of(kind), loss_fn=member.loss_fn)
            step = px.make_train_step(member.loss_fn, strategy_of(kind))
            found = None
            mesh = state.step.sharding.mesh
        else:
            found = resolve(member.build(), tx, member.batch, strategy_of(kind, split), loss_fn=member.loss_fn,
                            steps=STEPS)
            state = px.init_state(member.build(), tx, member.batch, strategy=found.strategy, loss_fn=member.loss_fn,
                                  mesh=found.mesh)
            step = px.make_train_step(member.loss_fn, found.strategy, found.step_options(px.StepOptions()))
            mesh = found.mesh
        self.search_s = time.perf_counter() - start if found is not None and found.choice is not None else None
        batch = px.data.to_global(member.batch, NamedSharding(mesh, strategy_of(kind).batch_spec()))
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        self.setup_s = time.perf_counter() - start  # planning, the search, compiling, one step
        self.mode, self.specs, self.describe = step.mode(), specs_of(state), step.describe()
        if found is not None and found.choice is not None:
            self.describe = f"{found.describe()}; {self.describe}"
        self.reshardings = [r.describe() for r in step.reshardings.get(self.mode, [])]

    def matches(self, config: Config, mode: str) -> bool:
        return mode == self.mode and specs_of(config.state) == self.specs


def build_configs(member: Member, kinds: list[str], tx) -> tuple[dict, dict, dict]:
    """Every configuration of ``kinds`` compiled (``label -> Config``, labels ``kind label``), the
    default of each kind (``kind -> label``) and what could not be built (``label -> reason``)."""
    configs, defaults, skipped = {}, {}, {}
    for kind in kinds:
        programs: dict = {}  # (layout, path) -> the configuration's name: splits that lay the params out alike
        try:
            default = Default(member, kind, tx)
            largest = Default(member, kind, tx, split="largest") if "fsdp" in kind else None
            pieces = Default(member, kind, tx, pieces=True) if "fsdp" in kind else None
        except Exception as exc:
            skipped[f"{kind} default"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            continue
        for label, split, mode in configurations(kind):
            name = f"{kind} {label}"
            try:
                strategy = strategy_of(kind, split)
                mesh = strategy.make_mesh()
                state = px.init_state(member.build(), tx, member.batch, strategy=strategy, loss_fn=member.loss_fn,
                                      mesh=mesh)
                placed = px.data.to_global(member.batch, NamedSharding(mesh, strategy.batch_spec()))
                program = (tuple(str(spec) for spec in specs_of(state)), mode)
                if program in programs:  # the same program as a split already built: one configuration, both names
                    same = programs[program]
                    renamed = f"{same.split('/')[0]}={label}"
                    configs[renamed] = configs.pop(same)
                    configs[renamed].label = programs[program] = renamed
                    defaults = {k: (renamed if n == same else n, d) for k, (n, d) in defaults.items()}
                    continue
                configs[name] = Config(name, px.make_train_step(member.loss_fn, strategy, compile=mode), state, placed)
                programs[program] = name
            except Exception as exc:
                skipped[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                continue
            if kind not in defaults and default.matches(configs[name], mode):
                defaults[kind] = (name, default)
            if largest is not None and f"{kind} split=largest" not in defaults and largest.matches(configs[name], mode):
                defaults[f"{kind} split=largest"] = (name, largest)
            if pieces is not None and f"{kind} pieces" not in defaults and pieces.matches(configs[name], mode):
                defaults[f"{kind} pieces"] = (name, pieces)
        if kind not in defaults:
            skipped[f"{kind} default"] = f"matched no configuration ({default.describe})"
    return configs, defaults, skipped


def peers_for(member: Member, kinds: list[str]) -> dict:
    """The peers' runners that express the same plan as a kind on this member: ``label -> (kind, runner)``."""
    from benchmarks import zoo_peers

    return zoo_peers.runners(member, kinds)


def search(member: Member, tx) -> tuple[dict, Config | None]:
    """``strategy="auto"`` on this member: the search's time and pick, and the pick compiled for timing."""
    from parallax.state.search import resolve

    start = time.perf_counter()
    found = resolve(member.build(), tx, member.batch, "auto", loss_fn=member.loss_fn)
    seconds = time.perf_counter() - start
    label = found.choice.picked
    mode = "shard_map" if label.endswith("shard_map") else "jit"
    state = px.init_state(member.build(), tx, member.batch, strategy=found.strategy, loss_fn=member.loss_fn,
                          mesh=found.mesh)
    placed = px.data.to_global(member.batch, NamedSharding(found.mesh, found.strategy.batch_spec()))
    config = Config(f"auto {label}", px.make_train_step(member.loss_fn, found.strategy, compile=mode), state, placed)
    return {"search_s": seconds, "pick": label, "candidates": len(found.choice.estimates),
            "timed": len(found.timed), "search_reported_s": found.seconds}, config


def bench(member: Member, kinds: list[str], rounds: int, with_peers: bool, with_search: bool) -> list[dict]:
    tx = optax.adamw(1e-3)
    configs, defaults, skipped = build_configs(member, kinds, tx)
    peers = peers_for(member, kinds) if with_peers else {}
    found, pick = search(member, tx) if with_search else ({}, None)
    runners = list(configs.values()) + [runner for _, runner in peers.values()] + ([pick] if pick else [])
    time_interleaved(runners, rounds)
    results = []
    for kind in kinds:
        mine = {name: c for name, c in configs.items() if name.startswith(f"{kind} ")}
        if kind not in defaults or not mine:
            results.append({"model": member.name, "family": member.family, "api": member.api, "kind": kind,
                            "skipped": {k: v for k, v in skipped.items() if k.startswith(f"{kind} ")}})
            continue
        name, default = defaults[kind]
        best = min(mine, key=lambda n: mine[n].median_s)
        largest = None
        if f"{kind} split=largest" in defaults:  # the fixed split the search replaces: what searching saved
            fixed = configs[defaults[f"{kind} split=largest"][0]]
            largest = {"label": fixed.label.split(" ", 1)[1], "over_best": round_ratios(fixed, configs[best]),
                       "default_search_s": default.search_s or 0.0,
                       "saves_s_per_1000_steps": 1000 * (fixed.median_s - configs[name].median_s)}
        pieces = None
        if f"{kind} pieces" in defaults:  # init_state + make_train_step, no steps=
            built = configs[defaults[f"{kind} pieces"][0]]
            pieces = {"label": built.label.split(" ", 1)[1], "over_best": round_ratios(built, configs[best]),
                      "setup_s": defaults[f"{kind} pieces"][1].setup_s}
        elif "fsdp" in kind:
            skipped[f"{kind} pieces"] = "the pieces' default matched no configuration"
        results.append({
            "model": member.name, "family": member.family, "api": member.api, "kind": kind,
            "default": name.split(" ", 1)[1], "best": best.split(" ", 1)[1], "pieces": pieces,
            "default_over_best": round_ratios(configs[name], configs[best]),
            "default_ms": 1e3 * configs[name].median_s, "best_ms": 1e3 * configs[best].median_s,
            "default_setup_s": default.setup_s, "default_describe": default.describe,
            "default_reshardings": default.reshardings, "split_largest": largest,
            "configs": {n.split(" ", 1)[1]: {"ms": 1e3 * c.median_s, "vs_default": round_ratios(c, configs[name]),
                                             "collective_mb": c.collective_total() / MB,
                                             "temp_mb": c.memory["temporaries"] / MB, "compile_s": c.compile_s}
                        for n, c in mine.items()},
            "peers": {label: {"ms": 1e3 * runner.median_s, "over_default": round_ratios(runner, configs[name]),
                              "notes": runner.notes}
                      for label, (peer_kind, runner) in peers.items() if peer_kind == kind},
            "skipped": {k: v for k, v in skipped.items() if k.startswith(f"{kind} ")},
        })
    if pick is not None:
        dp = configs.get(defaults["dp"][0]) if "dp" in defaults else None
        saved = 1000 * (dp.median_s - pick.median_s) if dp else None
        fastest = min(configs.values(), key=lambda c: c.median_s)
        results.append({"model": member.name, "family": member.family, "api": member.api, "kind": "auto", **found,
                        "pick_ms": 1e3 * pick.median_s, "dp_default_ms": 1e3 * dp.median_s if dp else None,
                        "saves_s_per_1000_steps": saved, "fastest_measured": fastest.label,
                        "pick_over_fastest": round_ratios(pick, fastest)})
    return results


def distribution(results: list[dict]) -> dict:
    """Per kind: how many defaults are within 10% of the best, the worst, and the median ratio; the
    same for the fixed ``split="largest"`` where FSDP is part of the kind, and over all kinds."""
    out = {}
    for kind in KINDS:
        out[kind] = _spread([r["default_over_best"]["median"] for r in results
                             if r["kind"] == kind and "default_over_best" in r])
    for kind in KINDS:
        out[f"{kind} split=largest"] = _spread([r["split_largest"]["over_best"]["median"] for r in results
                                                if r["kind"] == kind and r.get("split_largest")])
    for kind in KINDS:
        out[f"{kind} pieces"] = _spread([r["pieces"]["over_best"]["median"] for r in results
                                         if r["kind"] == kind and r.get("pieces")])
    out["all"] = _spread([r["default_over_best"]["median"] for r in results if "default_over_best" in r])
    out["all pieces"] = _spread([r["pieces"]["over_best"]["median"] if r.get("pieces")
                                 else r["default_over_best"]["median"]
                                 for r in results if "default_over_best" in r])
    return {name: spread for name, spread in out.items() if spread}


def _spread(ratios: list[float]) -> dict:
    """How the ratios spread against the goals: within 10%, over 1.3×, median and worst (empty: none)."""
    if not ratios:
        return {}
    return {"models": len(ratios), "within_10pct": sum(x <= 1.10 for x in ratios), "worst": max(ratios),
            "median": float(np.median(ratios)), "over_1.3": sum(x > 1.3 for x in ratios)}


def markdown(results: list[dict], meta: dict) -> str:
    lines = [f"# The zoo: default over best, per model and kind ({meta['devices']} {meta['platform']} devices, "
             f"jax {meta['jax']}, {meta['rounds']} rounds, AdamW, seed {meta['seed']})", "",
             "Each ratio: the default's step time over the fastest parallax configuration of the same kind, "
             "round by round, median (min–max). Peers: their step time over parallax's default.", "",
             "| kind | models | default within 10% of best | over 1.3× | median | worst |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for kind, d in meta["distribution"].items():
        lines.append(f"| {kind} | {d['models']} | {d['within_10pct']} ({100 * d['within_10pct'] / d['models']:.0f}%) "
                     f"| {d['over_1.3']} | {d['median']:.2f} | {d['worst']:.2f} |")
    peers = meta["peers"]
    faster = [f"{p['peer']} on {p['model']} {p['kind']} ({p['over_default']:.2f})" for p in peers["faster"]]
    lines += ["", f"Peers more than 10% faster than parallax's default (peer ÷ default below 1/1.1, by the median): "
              f"{len(faster)} of {peers['compared']} comparisons" + (f": {'; '.join(faster)}." if faster else ".")]
    lines += ["", "Where FSDP is part of the kind, the default prices FSDP's splits (`split=\"auto\"`, bounded by "
              "1,000 steps); *split=largest* is what the fixed split would train, over the best, and *search s / "
              "saved s* what the default's search took beside what it saves over 1,000 steps against that fixed "
              "split (the kinds' `split=largest` rows above: the same distribution for the fixed split); "
              "*pieces* is the default of `px.init_state` + `px.make_train_step` with no `steps=` (the kinds' "
              "`pieces` rows above; without FSDP the pieces build what the Trainer builds, so *all pieces* counts "
              "the default there). "
              "*Replicated* counts the tensors "
              "the compiler replicated to reshard them in the default's program (involuntary full "
              "rematerialization; `default_reshardings` in the JSON names each).", "",
              "| model | kind | default | best | default ÷ best | default ms | split=largest ÷ best "
              "| search s / saved s | pieces ÷ best "
              "| peers (÷ default) | replicated | setup s |",
              "| --- | --- | --- | --- | --- | ---: | --- | --- | --- | --- | ---: | ---: |"]
    for r in results:
        if r["kind"] == "auto" or "default_over_best" not in r:
            continue
        v = r["default_over_best"]
        peers = "; ".join(f"{label} {p['over_default']['median']:.2f} ({p['over_default']['min']:.2f}–"
                          f"{p['over_default']['max']:.2f})" for label, p in r["peers"].items())
        fixed = r.get("split_largest") or {}
        fixed_text = (f"{fixed['label']} {fixed['over_best']['median']:.2f} ({fixed['over_best']['min']:.2f}–"
                      f"{fixed['over_best']['max']:.2f})" if fixed else "")
        saved = f"{fixed['default_search_s']:.1f} / {fixed['saves_s_per_1000_steps']:.1f}" if fixed else ""
        built = r.get("pieces") or {}
        pieces_text = (f"{built['label']} {built['over_best']['median']:.2f} ({built['over_best']['min']:.2f}–"
                       f"{built['over_best']['max']:.2f})" if built else "")
        lines.append(f"| {r['model']} | {r['kind']} | {r['default']} | {r['best']} | {v['median']:.2f} "
                     f"({v['min']:.2f}–{v['max']:.2f}) | {r['default_ms']:.1f} | {fixed_text} | {saved} "
                     f"| {pieces_text} | {peers} | {len(r['default_reshardings'])} | {r['default_setup_s']:.1f} |")
    searched = [r for r in results if r["kind"] == "auto"]
    if searched:
        lines += ["", "## strategy=\"auto\": what the search costs and what it saves", "",
                  "| model | search s | candidates (timed) | pick | pick ms | DP default ms "
                  "| saved over 1,000 steps, s | pick ÷ fastest measured |",
                  "| --- | ---: | --- | --- | ---: | ---: | ---: | --- |"]
        for r in searched:
            v = r["pick_over_fastest"]
            lines.append(f"| {r['model']} | {r['search_s']:.1f} | {r['candidates']} ({r['timed']}) | {r['pick']} "
                         f"| {r['pick_ms']:.1f} | {_number(r['dp_default_ms'])} "
                         f"| {_number(r['saves_s_per_1000_steps'])} "
                         f"| {v['median']:.2f} ({v['min']:.2f}–{v['max']:.2f}) |")
    skipped = [(r["model"], r["kind"], k, why) for r in results for k, why in r.get("skipped", {}).items()]
    if skipped:
        lines += ["", "Not built:", ""] + [f"- {model} {label}: {why}" for model, _, label, why in skipped]
    return "\n".join(lines) + "\n"


def faster_peers(results: list[dict]) -> dict:
    """How many peer comparisons there are, and those where the peer ran more than 10% faster than
    parallax's default (its step time below the default's / 1.1, by the median)."""
    compared = [{"model": r["model"], "kind": r["kind"], "peer": label, "over_default": p["over_default"]["median"]}
                for r in results for label, p in r.get("peers", {}).items()]
    return {"compared": len(compared), "faster": [p for p in compared if p["over_default"] < 1 / 1.1]}


def _number(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"  # without the DP kind, nothing to compare with


def chart(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for x, kind in enumerate(KINDS):
        rows = [r for r in results if r["kind"] == kind and "default_over_best" in r]
        ys = [r["default_over_best"]["median"] for r in rows]
        jitter = np.random.default_rng(x).uniform(-0.2, 0.2, len(ys))
        ax.scatter(x + jitter, ys, s=18, alpha=0.8)
        for r, j in zip(rows, jitter):
            ax.plot([x + j] * 2, [r["default_over_best"]["min"], r["default_over_best"]["max"]], lw=0.6, alpha=0.4,
                    color="gray")
    ax.axhline(1.1, ls="--", color="orange", lw=1, label="1.1: within 10%")
    ax.axhline(1.3, ls="--", color="red", lw=1, label="1.3: never beyond")
    ax.set_xticks(range(len(KINDS)), KINDS)
    ax.set_ylabel("default ÷ best parallax config (median; bar: min–max)")
    ax.set_title("parallax defaults on the zoo")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(args) -> None:
    members = zoo(int(args.seed), args.scale)
    if args.models != "all":
        wanted = args.models.split(",")
        members = [m for m in members if m.name in wanted or m.family in wanted]
    kinds = args.kinds.split(",")
    with_peers, with_search = not args.no_peers, not args.no_search
    results, began = [], time.perf_counter()
    for member in members:
        start = time.perf_counter()
        searching = with_search and (args.search_models == "all" or member.name in args.search_models.split(","))
        results.extend(bench(member, kinds, args.rounds, with_peers, searching))
        mine = [r for r in results if r["model"] == member.name and "default_over_best" in r]
        print(f"{member.name}: " + ", ".join(f"{r['kind']} {r['default_over_best']['median']:.2f}" for r in mine)
              + f" ({time.perf_counter() - start:.0f} s)", flush=True)
    report(args, "zoo", results, markdown, seed=int(args.seed), distribution=distribution(results),
           peers=faster_peers(results), wall_s=round(time.perf_counter() - began))
    if not args.smoke:
        chart(results, os.path.join(args.out, "zoo.png"))


if __name__ == "__main__":
    main(ARGS)
