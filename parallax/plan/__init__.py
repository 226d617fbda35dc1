"""Know before you run: per-device memory and communication of each candidate strategy.

``px.plan(model, optimizer, example_batch, loss_fn=..., strategies=[...], devices=[8, 64],
memory_budget="16GB")`` plans every candidate without allocating the model: per-device bytes
of params, optimizer state, gradients and model state (exact, from the specs), and the real
train step compiled ahead of time on abstract arrays: its temporaries and peak
(``memory_analysis()``), its collective bytes by kind, and whether it fits each budget. A
device count this process does not have is planned in a subprocess with that many simulated
CPU devices; the same numbers as a process that has them (the tests check it).

The command line takes ``module:name`` references::

    python -m parallax.plan examples.plan_transformer:model --batch examples.plan_transformer:batch \\
        --loss examples.plan_transformer:loss_fn --devices 8,64 --budget 16GB,80GB

``parallax.plan`` is this module and is callable: ``px.plan(...)`` is :func:`plan`.

Example:
    >>> report = px.plan(model, optax.adamw(1e-3), batch, loss_fn=loss_fn, devices=8, memory_budget="1MB",
    ...                  strategies=["dp", px.FSDP(min_weight_size=0)])
    >>> [(row["strategy"], row["compile"] in ("jit", "shard_map"), report.fits(row, 0)) for row in report.rows]
    [('DataParallel(data=8)', True, True), ('FSDP(fsdp=8)', True, True)]
    >>> report.rows[1]["state"]["params"] < report.rows[0]["state"]["params"]
    True
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import sys
import types
from collections.abc import Sequence
from typing import Any

import jax

from parallax._errors import first_line
from parallax._units import format_bytes, parse_bytes
from parallax.models import unwrap_pretrained
from parallax.models.blocks import repeated_blocks
from parallax.parallel.candidates import AUTO
from parallax.parallel.context.attention import model_has_attention
from parallax.parallel.mesh_context import mesh_in_context
from parallax.parallel.names import parse_strategy
from parallax.plan import isolated
from parallax.plan.auto import plan_auto
from parallax.plan.candidates import DEFAULT_STRATEGIES, evaluate
from parallax.plan.fixes import find_fix
from parallax.plan.refs import resolve
from parallax.plan.table import render
from parallax.plan.target import check_target, deviceless, gpu_target_config
from parallax.pricing.hardware import Hardware, as_hardware
from parallax.sharding.strategy import Strategy
from parallax.sharding.topology import Topology
from parallax.step.options import StepOptions

log = logging.getLogger("parallax")


@dataclasses.dataclass(frozen=True)
class PlanReport:
    """The rows of :func:`plan`: ``str()`` is a table a person can read, ``as_dict()`` for programs.

    Attributes:
        rows: one dict per candidate and device count: ``strategy``, ``devices``, ``mesh``,
            ``compile`` (the path the cost model picks), ``timed`` (the paths priced so close that
            the step's first call times them and keeps the faster, where ``compile`` may change;
            the note says so), ``state`` (per-device bytes: ``params``,
            ``opt_state``, ``gradients``, ``model_state``, ``other``, ``total``, and ``host``:
            of ``total``, the bytes offloaded to host memory), ``compiled`` (device memory:
            ``arguments``, ``outputs``, ``temporaries``, ``aliased``; ``host``: host memory),
            ``peak`` (device memory), ``collectives`` (count and bytes by kind),
            ``collective_bytes``, ``links`` (over several hosts: ``hosts``, and the collective bytes
            moved ``inside`` a host and ``across`` hosts), ``backend``, ``note`` (why an FSDP candidate splits almost
            nothing, and that its paths are timed at the first call, else ``None``), or
            ``error`` for a candidate that does not apply.
        budgets: the memory budgets in bytes.
        labels: the budgets as given (``"16GB"``).
        target: the backend the plan is for.
        fixes: for each budget label no candidate fits (with several device counts, per count:
            ``"16GB on 8 devices"``), the options tried to make the smallest one fit
            (:mod:`parallax.plan.fixes`): the last fits if any does.
        hardware: the accelerator the rows' ``step`` is priced on (:class:`parallax.Hardware`), if given.
        picks: for ``strategies=["auto"]``, what it picks on each device count
            (:class:`parallax.plan.auto.Pick`: the pick, its step time, the runner-up); the rows it
            chose among have ``auto: True``.
    """

    rows: tuple[dict, ...]
    budgets: tuple[int, ...]
    labels: tuple[str, ...]
    target: str
    fixes: dict = dataclasses.field(default_factory=dict)
    hardware: Hardware | None = None
    picks: tuple = ()

    def fits(self, row: dict, budget: int = 0) -> bool:
        """Whether ``row``'s peak fits budget number ``budget`` (an index into ``budgets``)."""
        if not 0 <= budget < len(self.budgets):
            raise ValueError(f"budget={budget}: this plan has {len(self.budgets)} memory budget(s) "
                             f"{list(self.labels)}; pass memory_budget= to px.plan.")
        return row.get("error") is None and row["peak"] <= self.budgets[budget]

    @property
    def notes(self) -> list[str]:
        notes = ["Per device. State bytes and collective bytes are exact; the grads column is the gradient "
                 "sharded like the params, held within temps. peak = arguments + outputs - donated + temps, in "
                 "device memory; host: the state offloaded to host memory (offload=)."]
        other_units = [f"{label} = {format_bytes(budget)}" for label, budget in zip(self.labels, self.budgets)
                       if format_bytes(budget) != label and not label.isdigit()]
        if other_units:
            notes.append(f"Budgets in the table's units: {', '.join(other_units)}.")
        hosts = sorted({row["links"]["hosts"] for row in self.rows if row.get("links")})
        if hosts:
            notes.append(f"in host / across: the collective bytes moved over the links inside a host and between "
                         f"hosts ({' or '.join(map(str, hosts))} hosts), each collective by its device groups.")
        timed = [f"{row['strategy']} {1e3 * row['links']['seconds']:.3g} ms" for row in self.rows
                 if (row.get("links") or {}).get("seconds") is not None]
        if timed:
            notes.append("At the topology's bandwidths, the collectives' bytes take per step: " + "; ".join(timed)
                         + " (bytes over bandwidth, without latency or overlap).")
        if any(row.get("step") for row in self.rows):
            sources = sorted({row["step"]["source"] for row in self.rows if row.get("step")})
            notes.append(f"step: predicted on {self.hardware.describe()}: compute and memory by "
                         f"{' and '.join(sources)} (the step's FLOPs at the dense peak for its matmuls' dtype + its "
                         "bytes at the memory bandwidth; from the jaxpr, every loop iteration's matmuls and the bytes "
                         "as the target's compiler fuses), collectives on the links their device groups "
                         "span (ring bytes + a start-up latency each); data/FSDP/stage collectives overlap the "
                         "computation, tensor/context/expert ones wait on it. MFU: the program's FLOPs (with "
                         "recomputation) per second over the peak.")
        planned_on = sorted({row["backend"] for row in self.rows if not row.get("error")})
        named_gpu = self.hardware is not None and gpu_target_config(self.hardware) is not None
        if planned_on and planned_on != [self.target]:
            hint = (" For XLA's GPU compiler's own, without a GPU: pip install 'parallax-flax[gpu]'." if named_gpu
                    else "")
            notes.append(f"Temps and peak were compiled for {', '.join(planned_on)}; on {self.target} they are "
                         f"backend-dependent (fusion, layouts, scheduling): an estimate.{hint}")
        elif planned_on == ["gpu"] and named_gpu and jax.default_backend() != "gpu":
            notes.append(f"Temps and peak: compiled by XLA's GPU compiler for {self.hardware.name} without the GPUs "
                         "(no autotuning of its kernels, which needs them).")
        return notes

    def as_dict(self) -> dict:
        return {"rows": [dict(row) for row in self.rows], "budgets": dict(zip(self.labels, self.budgets)),
                "target": self.target, "notes": self.notes,
                "hardware": None if self.hardware is None else dataclasses.asdict(self.hardware),
                "fixes": {label: [fix.as_dict() for fix in tried] for label, tried in self.fixes.items()},
                "picks": [dataclasses.asdict(pick) for pick in self.picks]}

    def figure(self, path: str | None = None) -> Any:
        """A matplotlib figure: the first candidate's mesh, and per candidate each device's bytes
        at the step's peak by part (:mod:`parallax.plan.figure`), host memory apart, each
        budget a line; saved to ``path`` (PNG, SVG...) if given. Needs matplotlib."""
        from parallax.plan.figure import plan_bars
        from parallax.state.figure import draw

        return draw(plan_bars(self), dict(zip(self.labels, self.budgets)), "px.plan", path)

    def fix_lines(self) -> list[str]:
        """For each budget nothing fits: the option that would, with its numbers, or that none does."""
        lines = []
        for label, tried in self.fixes.items():
            base = tried[0].row.get("strategy", "?") if tried else "?"
            numbers = [f"{fix.change}: peak {format_bytes(fix.row['peak'])}"
                       + (f" + {format_bytes(fix.row['compiled']['host'])} in host memory"
                          if fix.row["compiled"].get("host") else "") + (" (fits)" if fix.fits else "")
                       if not fix.row.get("error") else f"{fix.change}: does not apply ({fix.row['error']})"
                       for fix in tried]
            verdict = (f"use {tried[-1].change}" if tried and tried[-1].fits else "none of these fits")
            lines.append(f"Nothing fits {label}; for {base}: {verdict}. Tried " + "; ".join(numbers) + ".")
        return lines

    def __str__(self) -> str:
        return render(self)


def plan(model: Any, optimizer: Any, example_batch: Any, *, loss_fn: Any,
         strategies: Sequence[str | Strategy] = DEFAULT_STRATEGIES, devices: int | Sequence[int] | None = None,
         memory_budget: int | str | Sequence[int | str] | None = None, target: str | None = None,
         isolate: bool | None = None, rng: Any = 0, topology: Topology | None = None,
         hardware: str | Hardware | None = None, **step_options: Any) -> PlanReport:
    """Plans each strategy on each device count without allocating the model.

    Args:
        model: as for :class:`parallax.Trainer` (a function that builds an NNX module is
            planned from shapes), or a ``"module:name"`` string.
        optimizer: an optax transformation (or ``"adamw"``, ``"adam"``, ``"sgd"``, or a
            ``"module:name"`` string).
        example_batch: one global batch: arrays or ``jax.ShapeDtypeStruct`` s.
        loss_fn: ``loss_fn(model, batch)``, as for the Trainer.
        strategies: px strategies, or short names: ``"dp"``, ``"fsdp"``, ``"tp"``, ``"pp"``, joined
            by ``+`` with optional sizes (``"fsdp+tp2"``, ``"pp2+fsdp"``); ``"auto"``: every mesh
            ``strategy="auto"`` would price on each count, planned, and its pick (:mod:`parallax.plan.auto`).
        devices: the device count(s) to plan for; this process's by default (a ``jax.set_mesh``'s
            around the call: its devices, and the mesh itself for a strategy it fits). A count this
            process does not have is planned in a subprocess with that many simulated CPU
            devices (objects travel by ``cloudpickle``; strings are imported there).
        memory_budget: bytes per device (``"16GB"``, ``"80GiB"`` or an int), or a list.
        target: the backend the plan is for (``"gpu"``, ``"tpu"``, ``"cpu"``): temporaries
            planned on another backend are marked as an estimate. This backend by default.
        isolate: always (``True``) or never (``False``) plan in a subprocess.
        rng: the init seed (shapes only; it does not change the plan).
        topology: the hosts to plan for (:class:`parallax.Topology`, e.g. 16 hosts of 8 devices), as
            simulated: each candidate's mesh is laid out over them as parallax lays it out over
            processes, and each row reports the collective bytes moved inside a host and across
            hosts (``links``). ``devices`` defaults to the topology's. With both of its bandwidths,
            layouts are chosen by the seconds their bytes take on the two links, and each row's
            ``links`` has them (``seconds``). Over several processes the rows report the bytes
            without it.
        hardware: the accelerator to plan for, by name (``"h100"``, ``"h200"``, ``"a100"``,
            ``"b200"``, ``"v4"``, ``"v5e"``, ``"v5p"``, ``"v6e"``) or a :class:`parallax.Hardware`:
            each row gets ``step``, the step's predicted time on it with tokens (examples) per second
            per device and MFU (:mod:`parallax.pricing.step_time`); ``memory_budget`` defaults to its
            memory and ``topology`` to its hosts (:meth:`parallax.Hardware.topology`). A TPU is
            compiled by the TPU compiler for a slice of ``devices`` chips (with ``libtpu``:
            ``pip install 'parallax-flax[tpu]'``), a named GPU by XLA's GPU compiler without the
            GPUs (with JAX's CUDA plugin: ``pip install 'parallax-flax[gpu]'``), else on CPU devices.
        **step_options: :class:`parallax.StepOptions` (``grad_accum``, ``precision``,
            ``remat``, ``compile``...) of the step to plan.

    Returns:
        A :class:`PlanReport`.
    """
    options = StepOptions.create(**step_options)
    hardware = as_hardware(hardware)
    around = mesh_in_context()  # a jax.set_mesh around the call: its devices, in its order
    local = list(around.devices.flat) if around is not None else jax.devices()
    if topology is not None and not isinstance(topology, Topology):
        raise ValueError(f"topology={topology!r}; give a px.Topology(hosts=..., devices_per_host=...).")
    default = [len(local)] if topology is None else [topology.devices]
    counts = default if devices is None else ([devices] if isinstance(devices, int) else list(devices))
    if not counts or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in counts):
        raise ValueError(f"devices={devices!r}; give a device count (an int >= 1) or a list of them.")
    if topology is not None and counts != [topology.devices]:
        raise ValueError(f"devices={devices!r} but {topology} has {topology.devices} devices; leave devices out "
                         "or give the topology's count.")

    def topology_for(count: int) -> Topology | None:  # the hardware's hosts, where no topology is given
        return topology if topology is not None or hardware is None else hardware.topology(count)

    for count in counts:  # a count the hardware's hosts do not divide, a TPU without libtpu: before compiling
        topology_for(count)
        check_target(hardware, count)
    given = [] if memory_budget is None else (
        list(memory_budget) if isinstance(memory_budget, (list, tuple)) else [memory_budget])
    if not given and hardware is not None:
        given = [f"{hardware.memory_gib:g}GiB"]
    budgets = tuple(parse_bytes(b) for b in given)
    wants_auto = any(isinstance(s, str) and s == AUTO for s in strategies)
    parsed = [parse_strategy(s) for s in strategies if not (isinstance(s, str) and s == AUTO)]  # before compiling
    on_tpu = hardware is not None and hardware.kind == "tpu"
    on_target = deviceless(hardware) and (on_tpu or isolate is not False)  # a GPU's, unless kept in this process
    if isolate is False and on_tpu:
        raise ValueError(f"hardware={hardware.name!r} is a TPU, planned by the TPU compiler in a subprocess; "
                         "leave isolate unset.")
    if isolate is False and max(counts) > len(local):
        raise ValueError(f"devices={max(counts)} but this process has {len(local)}; let it plan in a subprocess "
                         "(isolate=None or True).")
    model = unwrap_pretrained(model)[0]  # a Hugging Face model object: its module (a plan needs no params)
    args = {"model": model, "optimizer": optimizer, "batch": example_batch, "loss_fn": loss_fn}
    resolved: dict = {}

    def in_child(count: int) -> bool:
        return bool(isolate or on_target or (isolate is None and count > len(local)))

    def rows_for(strategies: list[Strategy], count: int, opts: StepOptions, state_budget: int | None = None,
                 bound_only: bool = False) -> list[dict]:
        if in_child(count):
            return isolated.run({**args, "strategies": strategies, "options": opts, "rng": rng, "topology":
                                 topology_for(count), "hardware": hardware, "state_budget": state_budget,
                                 "bound_only": bound_only}, count)
        if "model" not in resolved:
            resolved.update({kind: resolve(kind, value) for kind, value in args.items()})
        return [evaluate(resolved["model"], resolved["optimizer"], resolved["batch"], resolved["loss_fn"], strategy,
                         local[:count], opts, rng, topology_for(count), hardware, state_budget, bound_only)
                for strategy in strategies]

    rows = [row for count in counts for row in rows_for(parsed, count, options)]
    searched, picks = [], []
    here = [resolve(kind, args[kind]) for kind in ("model", "batch", "loss_fn")] if wants_auto else []
    for count in counts if wants_auto else ():
        budget = budgets[0] if budgets else None  # a candidate whose state alone exceeds it is not compiled
        bounds = None if hardware is None else lambda pool, count=count, budget=budget: rows_for(
            pool, count, options, budget, bound_only=True)
        found, picked = plan_auto(count,
                                  lambda pool, count=count, budget=budget: rows_for(pool, count, options, budget),
                                  *here, options.rng_streams, budget, hardware, bounds,
                                  isolated.side_by_side() if in_child(count) else 1)
        searched += found
        picks.append(picked)
    report = PlanReport(tuple(rows + searched), budgets, tuple(str(b) for b in given),
                        target or (hardware.kind if hardware is not None else jax.default_backend()), hardware=hardware,
                        picks=tuple(picks))
    fixes, memo = {}, {}
    for count, (index, (budget, label)) in itertools.product(counts if parsed else (),
                                                             enumerate(zip(budgets, report.labels))):
        planned = [(row, parsed[i % len(parsed)]) for i, row in enumerate(rows)
                   if row["devices"] == count and not row.get("error")]
        if not planned or any(report.fits(row, index) for row, _ in planned):
            continue
        _, strategy = min(planned, key=lambda pair: pair[0]["peak"])
        if "blocks" not in resolved:
            here = {kind: resolve(kind, args[kind]) for kind in ("model", "batch", "loss_fn")}
            try:
                resolved["blocks"] = repeated_blocks(here["model"], here["batch"], here["loss_fn"])
            except Exception as err:
                log.info("Could not read the model's repeated blocks (%s); remat is not tried.", first_line(err))
                resolved["blocks"] = ()
            try:
                resolved["attention"] = model_has_attention(here["model"], here["batch"], here["loss_fn"],
                                                            options.rng_streams)
            except Exception as err:
                log.info("Could not read whether the model computes attention (%s); ContextParallel is not among the "
                         "options tried.", first_line(err))
                resolved["attention"] = False
        def tried(opts: StepOptions, count: int, other: Strategy | None = None, strategy: Strategy = strategy) -> dict:
            planned = other or strategy  # each compiled once
            key = (planned.describe(), opts, count)
            if key not in memo:
                memo[key] = rows_for([planned], count, opts)[0]
            return memo[key]

        fixes[label if len(counts) == 1 else f"{label} on {count} devices"] = find_fix(
            tried, options, count, budget, resolved["blocks"], strategy=strategy, attention=resolved["attention"])
    return dataclasses.replace(report, fixes=fixes)


class _CallableModule(types.ModuleType):
    """``px.plan(...)`` calls :func:`plan`; ``python -m parallax.plan`` runs the command line."""

    def __call__(self, *args: Any, **kwargs: Any) -> PlanReport:
        return plan(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
