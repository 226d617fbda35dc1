"""The benchmark runner still runs: tiny models, one step per strategy."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.environment import child_env

pytestmark = pytest.mark.wide("the benchmarks' smoke runs, in processes of their own")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_benchmark_runner_smoke(tmp_path):
    env = child_env()
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "--smoke", "--models", "mlp",
                           "--strategies", "dp,fsdp,fsdp+tp", "--out", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "smoke.json").read_text())
    rows = {(r["model"], r["strategy"]) for r in report["results"]}
    # The CNN, the LM and the other strategies (TP and DP x FSDP take the hybrids' path) add compile
    # time, not coverage of the runner: they are left to `make bench`.
    assert rows == {("mlp", s) for s in ("dp", "fsdp", "fsdp+tp")}
    for row in report["results"]:
        assert row["step_ms"][row["best"]] > 0 and row["state_bytes_per_device"] > 0
        # Per-device state: each strategy stores what its spec says, no extra copies.
        assert row["state_ratio_to_ideal"] == pytest.approx(1.0, abs=0.01)
        if row["model"] == "mlp" and row["strategy"] in ("dp", "fsdp"):
            # The explicit recipe moves exactly the minimum (the compiler's plan may move less).
            assert row["collective_ratio_by_config"]["parallax/shard_map"] == pytest.approx(1.0, abs=0.05)
    assert (tmp_path / "smoke.md").read_text().startswith("# parallax benchmarks")
    assert (tmp_path / "smoke.png").stat().st_size > 0
    assert report["extras"]["grad_accum"]["k=4"]["collectives"]["reduce-scatter"] == \
        report["extras"]["grad_accum"]["k=1"]["collectives"]["reduce-scatter"]


def test_tp_layout_benchmark_smoke():
    env = child_env()
    proc = subprocess.run([sys.executable, "-m", "benchmarks.tp_layout", "--smoke", "--models", "mlp",
                           "--strategies", "fsdp+tp"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "| mlp | fsdp+tp |" in proc.stdout, proc.stdout


def test_nnx_vs_linen_benchmark_smoke():
    env = child_env()
    proc = subprocess.run([sys.executable, "-m", "benchmarks.nnx_vs_linen", "--smoke", "--models", "mlp",
                           "--strategies", "fsdp"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| mlp | fsdp |"))
    linen, nnx_loss, jitted = row.rstrip(" |").split("|")[-1].split(" / ")
    assert float(linen) == float(nnx_loss) == float(jitted), row  # one network from the same weights


def test_fsdp_split_benchmark_smoke():
    env = child_env()
    proc = subprocess.run([sys.executable, "-m", "benchmarks.fsdp_split", "--smoke", "--models", "mlp",
                           "--splits", "largest,output"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| mlp |")]
    default = re.search(r"the loss as written: mlp (largest/\w+)\)", proc.stdout).group(1)  # the cost model's pick
    assert len(rows) == 4 and "| mlp | largest/jit |" in proc.stdout, proc.stdout
    assert "1.00 (1.00–1.00)" in next(row for row in rows if row.startswith(f"| mlp | {default} |")), proc.stdout


def test_plan_rows_compare_names_every_difference_but_the_cost_models_seconds():
    """benchmarks/plan_rows.py's comparison (what shows a restructuring changed no plan) sees a changed figure, a
    changed pick and a missing case, and ignores the estimated seconds (they read this machine's speeds)."""
    from benchmarks.plan_rows import compare

    before = {"jax": "0.10.2", "plans": {"mlp": [{"peak": 100, "collectives": {"all-gather": {"bytes": 8}}}]},
              "auto": {"lm": {"h100": {"picks": [{"strategy": "DataParallel(data=8)", "seconds": 1.0}]}}}}
    same = {"jax": "0.12.0", "plans": {"mlp": [{"peak": 100, "collectives": {"all-gather": {"bytes": 8}}}]},
            "auto": {"lm": {"h100": {"picks": [{"strategy": "DataParallel(data=8)", "seconds": 1.5}]}}}}
    assert compare(before, same) == []
    moved = {"plans": {"mlp": [{"peak": 100, "collectives": {"all-gather": {"bytes": 16}}}]},
             "auto": {"lm": {"h100": {"picks": [{"strategy": "FSDP(fsdp=8)", "seconds": 1.0}]}}}}
    assert compare(before, moved) == [
        ".auto.lm.h100.picks[0].strategy: 'DataParallel(data=8)' before, 'FSDP(fsdp=8)' after",
        ".plans.mlp[0].collectives.all-gather.bytes: 8 before, 16 after"]
    assert compare(before, {"plans": {"mlp": []}}) == [".auto: only before", ".plans.mlp: 1 entries before, 0 after"]
