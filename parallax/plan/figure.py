"""The plan as a picture: per candidate, each device's bytes at the compiled step's peak, by part.

Each bar adds up to the row's ``peak`` (device memory): the state held on the device (params,
optimizer state, model state), the gradients and the other temporaries of the compiled step,
and the batch and outputs; the state offloaded to host memory follows, hatched.

Example:
    >>> report = px.plan(model, optax.adam(1e-3), batch, loss_fn=loss_fn, devices=8, strategies=["dp"])
    >>> bars = plan_bars(report)
    >>> sum(bars[0].device.values()) == report.rows[0]["peak"]
    True
"""

from __future__ import annotations

from typing import Any

from parallax.state.figure import MemoryBar


def plan_bars(report: Any) -> list[MemoryBar]:
    """One :class:`~parallax.state.figure.MemoryBar` per row of a :class:`parallax.plan.PlanReport`
    that applies."""
    bars = []
    for row in report.rows:
        if row.get("error"):
            continue
        state, compiled = row["state"], row["compiled"]
        host = state["host"]
        opt_host = min(host, state["opt_state"])  # offload levels move the optimizer state first, then the params
        params_host = host - opt_host
        temporaries = compiled["temporaries"]
        gradients = min(state["gradients"], temporaries)
        device = {"params": state["params"] - params_host, "optimizer state": state["opt_state"] - opt_host,
                  "model state": state["model_state"] + state["other"]}  # the state held on the device
        device.update({"gradients": gradients, "activations and temporaries": temporaries - gradients,
                       "batch and outputs": row["peak"] - sum(device.values()) - temporaries})
        bars.append(MemoryBar(f"{row['strategy']} ({row['compile']})", device, compiled.get("host", 0) or host,
                              dict(row["mesh"])))
    return bars
