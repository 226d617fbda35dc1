"""A plan's table, as ``str(report)`` prints it: one row per candidate, then what was skipped, said,
fixed and picked, then the notes (:class:`parallax.plan.PlanReport`)."""

from __future__ import annotations

from typing import Any

from parallax._units import format_bytes

_KINDS = (("all-gather", "AG"), ("all-reduce", "AR"), ("reduce-scatter", "RS"), ("all-to-all", "A2A"),
          ("collective-permute", "CP"))


def render(report: Any) -> str:
    """``report`` (a :class:`parallax.plan.PlanReport`) as a table a person can read."""
    host = any(row.get("compiled", {}).get("host") for row in report.rows if not row.get("error"))
    links = any(row.get("links") for row in report.rows if not row.get("error"))
    timed = any(row.get("step") for row in report.rows if not row.get("error"))
    header = ["devices", "strategy", "compile", "params", "opt state", "grads", "model st", "temps", "peak",
              *(["host"] if host else []), "moved", *(["in host", "across"] if links else []),
              *(short for _, short in _KINDS), *(f"fits {label}" for label in report.labels),
              *(["step", "tok/s/dev" if any((r.get("step") or {}).get("tokens_per_second") for r in report.rows)
                 else "ex/s/dev", "MFU"] if timed else [])]
    cells, skipped = [], []
    for row in report.rows:
        if row.get("error"):
            said = row["error"] if row.get("pruned") else f"does not apply: {row['error']}"  # pruned: it applies
            skipped.append(f"{row['devices']} devices, {row['strategy']}: {said}")
            continue
        state, kinds = row["state"], row["collectives"]
        cells.append([str(row["devices"]), row["strategy"], row["compile"], *(format_bytes(state[k]) for k in (
            "params", "opt_state", "gradients", "model_state")), format_bytes(row["compiled"]["temporaries"]),
            format_bytes(row["peak"]), *([format_bytes(row["compiled"]["host"])] if host else []),
            format_bytes(row["collective_bytes"]),
            *([format_bytes(row["links"]["inside"]), format_bytes(row["links"]["across"])] if links and
              row.get("links") else ["-", "-"] if links else []),
            *(format_bytes(kinds[kind]["bytes"]) if kinds[kind]["count"] else "-" for kind, _ in _KINDS),
            *("yes" if report.fits(row, i) else "no" for i in range(len(report.budgets))),
            *(_step_cells(row["step"]) if timed else [])])
    widths = [max(len(r[i]) for r in [header, *cells]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
             for r in [header, *cells]]
    said = [f"{row['devices']} devices: {row['note']}" for row in report.rows
            if not row.get("error") and row.get("note")]
    return "\n".join(lines + [f"  {s}" for s in skipped + said + report.fix_lines()]
                     + [pick.describe() for pick in report.picks]
                     + [f"note: {n}" for n in report.notes])


def _step_cells(step: dict) -> list[str]:
    rate = step["tokens_per_second"] if step.get("tokens_per_second") is not None else step["examples_per_second"]
    seconds = step["seconds"]
    shown = f"{1e3 * seconds:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"
    return [shown, f"{rate:,.0f}" if rate >= 100 else f"{rate:.3g}", f"{100 * step['mfu']:.1f}%"]
