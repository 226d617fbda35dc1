"""Pictures of where the memory goes: the mesh with its axes, and per device the bytes of each
part of the state (and, for a compiled step, its gradients and temporaries) against a budget.

``px.summarize(state).figure("state.png")`` and ``px.plan(...).figure("plan.png")`` draw them;
``python -m parallax.plan ... --plot plan.png`` too. matplotlib is optional: only drawing
imports it, and a clear error says how to install it where it is missing.

Example:
    >>> bars = summary_bars(px.summarize(state))
    >>> bars[0].total == px.summarize(state).totals["total"]["per_device"]
    True
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from parallax._units import binary_unit, format_bytes

COLORS = {"params": "#4C72B0", "optimizer state": "#DD8452", "model state": "#55A868", "other": "#8C8C8C",
          "gradients": "#C44E52", "activations and temporaries": "#8172B3", "batch and outputs": "#CCB974"}
HOST = "#B0B0B0"


@dataclasses.dataclass(frozen=True)
class MemoryBar:
    """One bar of a figure: a device's bytes by part in device memory, and its bytes in host memory.

    Attributes:
        label: what the bar is (the strategy and device count).
        device: part name -> bytes in device memory, in drawing order.
        host: bytes this device's shards keep in host memory (offloaded state).
        mesh: the mesh's axis name -> size.
    """

    label: str
    device: dict[str, int]
    host: int
    mesh: dict[str, int]

    @property
    def total(self) -> int:
        """Bytes per device, device and host memory together."""
        return sum(self.device.values()) + self.host


def summary_bars(summary: Any) -> list[MemoryBar]:
    """The bar of a :class:`parallax.state.summary.Summary`: its per-device totals, device and host apart."""
    totals = summary.totals
    names = {"params": "params", "opt_state": "optimizer state", "model_state": "model state", "other": "other"}
    device = {label: totals[part]["per_device"] - totals[part]["host"] for part, label in names.items()}
    label = summary.strategy if not summary.strategy.startswith("(") else f"{math.prod(summary.mesh.values())} devices"
    return [MemoryBar(label, device, totals["total"]["host"], dict(summary.mesh))]


def draw(bars: Sequence[MemoryBar], budgets: dict[str, int] | None = None, title: str = "",
         path: str | None = None) -> Any:
    """A matplotlib figure: the first bar's mesh (a grid of devices, its axes named) beside one
    horizontal bar per :class:`MemoryBar`, parts stacked in device memory, host memory hatched
    after them, each budget a dashed line. Saved to ``path`` (PNG, SVG, PDF: by its suffix) if given.

    Raises:
        ImportError: matplotlib is not installed (the message says how to install it).
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError("parallax draws its figures with matplotlib: pip install matplotlib") from err
    if not bars:
        raise ValueError("Nothing to draw: no candidate applied (every row of the plan is an error).")
    mesh_rows = math.prod(list(bars[0].mesh.values())[:-1]) if len(bars[0].mesh) > 1 else 1
    mesh_height, bar_height = 0.9 + 0.35 * mesh_rows, 0.9 + 0.45 * len(bars)
    # Not pyplot's figure: nothing global is kept. The mesh above, the bars below, laid out by matplotlib.
    figure = Figure(figsize=(11, mesh_height + bar_height + 0.6), layout="constrained")
    mesh_ax, bar_ax = figure.subplots(2, 1, height_ratios=[mesh_height, bar_height])
    _draw_mesh(mesh_ax, bars[0].mesh)
    scale, unit = binary_unit(max(bar.total for bar in bars))
    for row, bar in enumerate(bars):
        left = 0.0
        for part, size in bar.device.items():
            bar_ax.barh(row, size / scale, left=left, color=COLORS.get(part, "#999999"), label=part, edgecolor="white")
            left += size / scale
        if bar.host:
            bar_ax.barh(row, bar.host / scale, left=left, color=HOST, hatch="//", label="in host memory",
                        edgecolor="white")
        device = sum(bar.device.values())
        bar_ax.annotate(format_bytes(device) + (f" + {format_bytes(bar.host)} host" if bar.host else ""),
                        (bar.total / scale, row), xytext=(4, 0), textcoords="offset points", va="center", fontsize=8)
    for name, budget in (budgets or {}).items():
        bar_ax.axvline(budget / scale, color="black", linestyle="--", linewidth=1)
        bar_ax.annotate(f"budget {name}", (budget / scale, 1.0), xycoords=("data", "axes fraction"), xytext=(0, 2),
                        textcoords="offset points", ha="center", va="bottom", fontsize=8)
    bar_ax.set_yticks(range(len(bars)), [bar.label for bar in bars])
    bar_ax.invert_yaxis()
    bar_ax.set_xlabel(f"per device ({unit})")
    bar_ax.set_xlim(0, 1.18 * max([bar.total / scale for bar in bars] + [b / scale for b in (budgets or {}).values()]))
    handles, labels = bar_ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    bar_ax.legend(unique.values(), unique.keys(), loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8,
                  frameon=False)
    mesh_ax.set_title(f"mesh of {bars[0].label}: " + mesh_ax.get_title(), fontsize=9)
    if title:
        figure.suptitle(title)
    if path is not None:
        figure.savefig(path, dpi=120)
    return figure


def _draw_mesh(ax: Any, mesh: dict[str, int]) -> None:
    """The devices as a grid: the last axis across, the others down (their coordinates on each row)."""
    names, sizes = list(mesh), list(mesh.values())
    across = sizes[-1] if sizes else 1
    down = math.prod(sizes[:-1]) if len(sizes) > 1 else 1
    for index in range(across * down):
        row, col = divmod(index, across)
        ax.add_patch(_box(col, down - 1 - row))
        ax.text(col + 0.5, down - 0.5 - row, str(index), ha="center", va="center", fontsize=7 if across > 16 else 8)
    ax.set_xlim(-0.2, across + 0.2)
    ax.set_ylim(-0.2, down + 0.2)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(" × ".join(f"{name}={size}" for name, size in mesh.items()), fontsize=9)
    ax.annotate(f"{names[-1]} →" if names else "", (across / 2, -0.15), ha="center", va="top", fontsize=8,
                annotation_clip=False)
    if len(names) > 1:
        ax.annotate(f"{' × '.join(names[:-1])} ↓", (-0.15, down / 2), ha="right", va="center", fontsize=8,
                    rotation=90, annotation_clip=False)


def _box(x: int, y: int) -> Any:
    from matplotlib.patches import Rectangle

    return Rectangle((x + 0.05, y + 0.05), 0.9, 0.9, facecolor="#E8EEF7", edgecolor="#4C72B0")
