"""One candidate of a plan: plan the state, compile the real train step, read its costs.

Nothing is allocated: the state is planned from shapes (:func:`parallax.plan_state`) and the
step is compiled ahead of time on abstract arrays placed on the candidate's mesh, so the
bytes and collectives are those of the step that would run.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import jax

from parallax import inspect
from parallax._errors import first_line
from parallax.parallel.mesh_context import mesh_in_context, mesh_on
from parallax.pricing.choice import choose
from parallax.pricing.fused_bytes import matmul_dtype
from parallax.pricing.hardware import Hardware
from parallax.pricing.host_layout import cheapest_layout, link_seconds
from parallax.pricing.step_time import lower_bound, speeds, step_time
from parallax.pricing.timing import closest
from parallax.sharding.strategy import Strategy, combine
from parallax.sharding.topology import Topology, crossing_axes, hosts_of
from parallax.state.candidate import plan_candidate, without_memories
from parallax.state.plan import unsharded_reason, warn_if_crossing
from parallax.step.options import StepOptions

DEFAULT_STRATEGIES = ("dp", "fsdp", "tp", "dp2+fsdp", "fsdp+tp2")


def _estimate(step: Any, compiled: Any, mesh: Any, topology: Topology | None) -> float:
    """The cost model's step seconds for ``compiled``: the path choice's where the step chose one, else
    priced here (a step with one path, e.g. context parallelism's ``jit``, compiles without choosing)."""
    if step.choice is not None:
        return step.choice.estimates.get(step.mode(), step.choice.estimates[step.choice.picked]).seconds
    return choose({step.mode(): compiled}, list(mesh.devices.flat), topology=topology,
                  speeds=step.speeds).estimates[step.mode()].seconds


def with_options(strategy: Strategy, **options: Any) -> Strategy:
    """``strategy`` with ``options`` set on every part that has them (``min_weight_size`` and
    ``split`` reach the FSDP part of a hybrid); an option no part has is an error.

    Example:
        >>> with_options(px.combine(px.DataParallel(2), px.FSDP()), min_weight_size=0).parts[1].min_weight_size
        0
    """
    if not options:
        return strategy
    parts, used = [], set()
    for part in strategy.parts:
        fields = {field.name for field in dataclasses.fields(part)} & set(options)
        used |= fields
        parts.append(dataclasses.replace(part, **{name: options[name] for name in fields}))
    unknown = sorted(set(options) - used)
    if unknown:
        raise ValueError(f"{strategy.describe()} has no option {unknown[0]!r} (its parts take "
                         f"{sorted({f.name for p in strategy.parts for f in dataclasses.fields(p)})}).")
    return parts[0] if len(parts) == 1 else combine(*parts)


def evaluate(model: Any, optimizer: Any, example_batch: Any, loss_fn: Any, strategy: Strategy,
             devices: Sequence[jax.Device], options: StepOptions, rng: Any = 0, topology: Topology | None = None,
             hardware: Hardware | None = None, state_budget: int | None = None, bound_only: bool = False) -> dict:
    """The costs of one candidate on ``devices``, as a JSON-able dict (``error`` when it does not apply;
    ``over_budget`` too where its state alone exceeds ``state_budget`` bytes a device: not compiled).

    With ``bound_only`` (and a ``hardware``), nothing compiles: the row has the state, the mesh and
    ``bound``, the seconds its step takes at least on the hardware, from its jaxpr
    (:func:`parallax.pricing.step_time.lower_bound`; ``None`` where the step would be priced from its
    compiled program instead: planned on the hardware itself).

    Over several hosts (the processes, or ``topology`` as simulated) parallax's own mesh is laid out
    as the Trainer lays it out, by the bytes the step moves across hosts
    (:mod:`parallax.pricing.host_layout`), and the row also has ``links``: the collective bytes per
    device moved inside a host and across hosts (``inside``, ``across``), split by the device
    groups of each collective and the host of each device, the ``inside_first`` order and the
    ``crossing`` axes."""
    row = {"strategy": strategy.describe(), "devices": len(devices), "backend": devices[0].platform}
    try:  # a jax.set_mesh's mesh where it fits; laid out over the topology's hosts where one is given
        mesh = mesh_on(strategy, devices, topology)
        row["mesh"] = {name: int(size) for name, size in mesh.shape.items()}
        candidate = plan_candidate(model, optimizer, example_batch, loss_fn, strategy, mesh=mesh, options=options,
                                   rng=rng, topology=topology)  # its compile paths priced on the topology's links
        plan, totals, step = candidate.plan, candidate.totals, candidate.step
        over = candidate.over_budget(state_budget)
        if over:  # pruned before compiling, as the search prunes
            return {**row, "error": over, "over_budget": True}
        if hardware is not None:  # and at the hardware's speeds, not measured on devices that stand in for it
            step.speeds = speeds(hardware, "bf16" if options.policy.casts else "fp32")
        batch = candidate.batch
        if bound_only:
            return {**row, "strategy": plan.strategy.describe(mesh), "error": None, "state": state_bytes(totals),
                    "bound": None if hardware is None else _bound(step, plan, batch, hardware, mesh, totals)}
        compiled = candidate.compiled()  # the program the step compiled, not a second one
        jaxpr = step.trace(plan.abstract_arrays(), batch).jaxpr.jaxpr if hardware is not None else None
    except (ValueError, TypeError) as err:  # a candidate that does not apply: the sizes, a rule, the batch
        return {**row, "error": first_line(err)}
    except Exception as err:
        if "RESOURCE_EXHAUSTED" not in str(err) or "totals" not in locals():
            raise
        return over_memory(row, str(err), totals, plan.strategy.describe(mesh))
    memory = host_placed(inspect.memory_bytes(compiled), totals["total"]["host"], list(mesh.devices.flat))
    text = compiled.as_text()
    traffic = inspect.collective_bytes(text)
    layout = None
    if mesh is not mesh_in_context():  # parallax's own mesh: over several hosts, laid out by the bytes it moves
        layout = cheapest_layout(text, plan.strategy, mesh, topology)
    else:
        warn_if_crossing(plan.strategy, mesh)
    laid = mesh if layout is None else layout.mesh  # the same program; its devices placed by host
    hosts = hosts_of(list(laid.devices.flat), topology)
    if len(set(hosts.tolist())) > 1:
        split = inspect.collective_bytes_by_link(text, hosts)
        row["links"] = {"hosts": len(set(hosts.tolist())),
                        **{link: sum(stat.bytes for stat in kinds.values()) for link, kinds in split.items()},
                        "inside_first": list(layout.inside_first) if layout else None,
                        "crossing": list(crossing_axes(laid, topology))}
        row["links"]["seconds"] = link_seconds(row["links"]["inside"], row["links"]["across"], topology)
    row.update(
        strategy=plan.strategy.describe(mesh), compile=step.mode(), error=None, state=state_bytes(totals),
        compiled=memory,
        peak=inspect.peak_bytes(memory),
        collectives={kind: {"count": stat.count, "bytes": stat.bytes} for kind, stat in traffic.items()},
        collective_bytes=sum(stat.bytes for stat in traffic.values()),
        params=totals["params"]["count"],
        timed=closest(step.choice, options.timed_candidates) if step.choice is not None else [],
        estimate=_estimate(step, compiled, mesh, topology),
    )
    close = (f"{' and '.join(row['timed'])} are priced within the cost model's error: the first call times them and "
             f"keeps the faster (these figures are {step.mode()}'s)") if row["timed"] else None
    by_bytes = layout.describe() if layout and layout.inside_first != plan.strategy.inside_first() else None
    row["note"] = "; ".join(n for n in (unsharded_reason(plan), close, by_bytes) if n) or None
    if hardware is not None:
        row["step"] = priced_step(compiled, jaxpr, hardware, plan.strategy, laid, hosts, memory["host"],
                                  example_batch, *_state_share(plan, totals))
    return row


def _bound(step: Any, plan: Any, batch: Any, hardware: Hardware, mesh: Any, totals: dict) -> float | None:
    """The least seconds ``step`` takes on ``hardware`` over its paths, from their jaxprs, nothing compiled
    (``None`` where :func:`priced_step` would read the compiled program instead)."""
    if _runs_on(mesh) == hardware.kind:
        return None
    shapes, fraction = _state_share(plan, totals)
    return min(lower_bound(jaxpr, hardware, dtype=matmul_dtype(jaxpr), devices=mesh.devices.size,
                           state_shapes=shapes, state_fraction=fraction)
               for jaxpr in step.jaxprs(plan.abstract_arrays(), batch).values())


def _state_share(plan: Any, totals: dict) -> tuple[list[tuple[int, ...]], float]:
    """The train state's leaves' shapes and its bytes per device over its global bytes, as the step's
    bytes from its jaxpr are priced (:func:`parallax.pricing.step_time.jaxpr_costs`)."""
    shapes = [tuple(leaf.shape) for leaf in jax.tree.leaves(plan.abstract_arrays())]
    return shapes, totals["total"]["per_device"] / max(totals["total"]["global"], 1)


def host_placed(memory: dict[str, int], host: int, devices: Sequence[jax.Device]) -> dict[str, int]:
    """``memory`` (a deviceless GPU's compiled step, see :func:`parallax.state.candidate.host_counted`) with
    the ``host`` bytes of offloaded state moved from its arguments, outputs and donated buffers to host memory."""
    if not host or memory["host"] or not without_memories(devices):
        return memory
    return {"arguments": memory["arguments"] - host, "outputs": memory["outputs"] - host,
            "temporaries": memory["temporaries"], "aliased": max(memory["aliased"] - host, 0), "host": host}


def state_bytes(totals: dict) -> dict:
    """A row's ``state``: per-device bytes by part of the train state (:func:`parallax.summarize`'s totals)."""
    return {"params": totals["params"]["per_device"], "opt_state": totals["opt_state"]["per_device"],
            "gradients": totals["params"]["per_device"], "model_state": totals["model_state"]["per_device"],
            "other": totals["other"]["per_device"], "total": totals["total"]["per_device"],
            "host": totals["total"]["host"]}


def over_memory(row: dict, message: str, totals: dict, strategy: str) -> dict:
    """The row of a candidate the TPU compiler would not compile because its device cannot hold it:
    the state exact, the temporaries the compiler said it needs, no collectives read."""
    found = re.search(r"HLO temporaries \(([\d.]+)([KMGT]?)\)", message)
    scale = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    temporaries = int(float(found.group(1)) * scale[found.group(2)]) if found else 0
    state = totals["total"]["per_device"] - totals["total"]["host"]
    said = re.sub(r"\s+", " ", message[message.index("RESOURCE_EXHAUSTED"):]).split(". ")[0][:300]
    return {**row, "strategy": strategy, "compile": "jit", "error": None, "state": state_bytes(totals),
            "compiled": {"arguments": state, "outputs": state, "temporaries": temporaries, "aliased": state, "host": 0},
            "peak": state + temporaries, "collective_bytes": 0, "params": totals["params"]["count"], "timed": [],
            "collectives": {kind: {"count": 0, "bytes": 0} for kind in inspect.COLLECTIVES},
            "note": f"does not fit: the {row['backend'].upper()} compiler stopped ({said}); the peak is the state + "
                    "the temporaries it said it needs, and nothing else was read"}


def _runs_on(mesh: Any) -> str:
    """The platform the mesh's devices run programs on: ``"none"`` for a TPU slice described deviceless."""
    platform = mesh.devices.flat[0].platform
    return platform if platform == jax.default_backend() else "none"


def priced_step(compiled: Any, jaxpr: Any, hardware: Hardware, strategy: Strategy, mesh: Any, hosts: Any,
                host_bytes: int, example_batch: Any, state_shapes: Any = (), state_fraction: float = 1.0) -> dict:
    """A row's ``step``: the predicted step on ``hardware``, examples (and tokens, for a batch of
    token ids) per second per device, and MFU."""
    critical = [part.axis for part in strategy.parts if part.critical_path]
    dtype = matmul_dtype(jaxpr)
    timed = step_time(compiled, hardware, dtype=dtype, mesh_shape={k: int(v) for k, v in mesh.shape.items()},
                      critical_axes=critical, hosts=hardware.domains(hosts), host_bytes=host_bytes,
                      backend=_runs_on(mesh), jaxpr=jaxpr, state_shapes=state_shapes,
                      state_fraction=state_fraction)
    devices = mesh.devices.size
    leaves = jax.tree.leaves(example_batch)
    examples = int(jax.numpy.shape(leaves[0])[0])
    tokens = next((examples * int(leaf.shape[1]) for leaf in leaves
                   if len(leaf.shape) >= 2 and jax.numpy.issubdtype(leaf.dtype, jax.numpy.integer)), None)
    per_device = 1 / (timed.seconds * devices) if timed.seconds > 0 else 0.0
    return {**timed.as_dict(), "dtype": dtype, "hardware": hardware.name,
            "examples_per_second": examples * per_device,
            "tokens_per_second": None if tokens is None else tokens * per_device}
