"""The figures of px.summarize and px.plan draw the numbers of the summary and of the plan, for a
linen and an NNX model, and the command line writes one."""

from __future__ import annotations

import optax
import pytest
from flax import nnx

import parallax as px
from parallax.plan.figure import plan_bars
from parallax.state.figure import COLORS, HOST, summary_bars
from tests.models import MLP, batches, classifier_loss

pytestmark = pytest.mark.core

DATA = batches("mlp", 1, batch_size=16)[0]
FSDP = px.FSDP(min_weight_size=0, split="largest")


class NNXMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up, self.down = nnx.Linear(24, 64, rngs=rngs), nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.relu(self.up(x)))


def nnx_loss(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()


MODELS = {"linen": (MLP, classifier_loss), "nnx": (lambda: NNXMLP(nnx.Rngs(0)), nnx_loss)}


def drawn(figure) -> tuple[dict[str, float], float]:
    """Bytes per part as drawn on the bar axis (its patches' widths times the axis unit), and the host bytes."""
    bar_ax = figure.axes[1]
    unit = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "B": 1}[bar_ax.get_xlabel().split("(")[1].rstrip(")")]
    by_color = {color: name for name, color in COLORS.items()}
    parts, host = {}, 0.0
    for patch in bar_ax.patches:
        color = "#{:02X}{:02X}{:02X}".format(*(round(255 * c) for c in patch.get_facecolor()[:3]))
        if color == HOST:
            host += patch.get_width() * unit
        else:
            parts[by_color[color]] = parts.get(by_color[color], 0.0) + patch.get_width() * unit
    return parts, host


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_summary_figure_draws_the_summary(name, tmp_path):
    build, loss = MODELS[name]
    model = build() if name == "linen" else build
    state = px.init_state(model, optax.adam(1e-3), DATA, strategy=FSDP, loss_fn=loss,
                          options=px.StepOptions(offload="optimizer", compile="jit"))
    summary = px.summarize(state)
    (bar,) = summary_bars(summary)
    totals = summary.totals
    assert bar.host == totals["opt_state"]["per_device"] == totals["total"]["host"] > 0  # offloaded: host memory
    assert bar.device["params"] == totals["params"]["per_device"] and bar.device["optimizer state"] == 0
    assert bar.total == totals["total"]["per_device"] and bar.mesh == {"fsdp": 8}
    figure = summary.figure(tmp_path / "state.png", budget="1MB")
    parts, host = drawn(figure)
    assert parts["params"] == pytest.approx(totals["params"]["per_device"], rel=1e-9)
    assert host == pytest.approx(totals["total"]["host"], rel=1e-9)
    assert (tmp_path / "state.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    mesh_ax = figure.axes[0]
    assert len(mesh_ax.patches) == 8 and "fsdp=8" in mesh_ax.get_title()  # one box per device, the axis named


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_plan_figure_draws_each_row_to_its_peak(name, tmp_path):
    build, loss = MODELS[name]
    model = build() if name == "linen" else build
    report = px.plan(model, optax.adamw(1e-3), DATA, loss_fn=loss, devices=8, memory_budget="1MB",
                     strategies=[px.DataParallel(), px.combine(px.DataParallel(2), FSDP)], compile="jit")
    bars = plan_bars(report)
    assert len(bars) == 2 and [b.mesh for b in bars] == [{"data": 8}, {"data": 2, "fsdp": 4}]
    for bar, row in zip(bars, report.rows):
        assert sum(bar.device.values()) == row["peak"] and min(bar.device.values()) >= 0
        assert bar.device["params"] == row["state"]["params"] and bar.device["gradients"] == row["state"]["gradients"]
        assert bar.host == row["compiled"]["host"] == 0
    figure = report.figure(str(tmp_path / "plan.svg"))
    assert (tmp_path / "plan.svg").read_text().lstrip().startswith("<?xml")
    parts, _ = drawn(figure)
    assert sum(parts.values()) == pytest.approx(sum(row["peak"] for row in report.rows), rel=1e-9)
    assert "2 × fsdp=4" not in figure.axes[0].get_title() and "data=8" in figure.axes[0].get_title()


LINEN_MLP = MLP()


def test_the_cli_writes_the_figure(tmp_path, capsys):
    from parallax.plan.__main__ import main

    out = tmp_path / "plan.png"
    assert main(["tests.test_figures:LINEN_MLP", "--batch", "tests.test_figures:DATA", "--loss",
                 "tests.models:classifier_loss", "--devices", "8", "--strategies", "dp", "--compile", "jit",
                 "--plot", str(out)]) == 0
    assert f"figure: {out}" in capsys.readouterr().out and out.read_bytes()[:4] == b"\x89PNG"
