"""The time of one compiled training step on a named accelerator (:class:`parallax.Hardware`).

Read from the compiled program, priced at the data sheet's figures:

- **compute and memory**: the program's FLOPs (``cost_analysis()``, plus the matmuls its loops
  run after their first iteration: a scanned stack, a pipeline's schedule, accumulation) at the
  dense peak for the step's compute dtype, plus its bytes accessed at the memory bandwidth
  (the roofline's two terms, added: matmuls and the memory-bound ops between them take turns).
  A program compiled on other devices than the hardware's (a GPU planned on CPU devices, a TPU
  slice compiled without one) is read from its jaxpr instead: every loop iteration's matmuls, and
  the bytes as a GPU or TPU compiler fuses (:mod:`parallax.pricing.fused_bytes`).
- **collectives**, each on the link its device groups run over (inside a fast domain: NVLink,
  ICI; across: the network), as a ring moves them: an all-gather or reduce-scatter of ``S``
  bytes over ``g`` devices takes ``(g-1)/g · S`` per device, an all-reduce twice that, an
  all-to-all ``(g-1)/g · S``, a permute ``S``; plus one start-up latency per call.
- **what overlaps**: collectives over the data, FSDP and pipeline axes (gradients reduced,
  params gathered, stages' activations sent) run asynchronously beside the computation and cost
  only what exceeds it; those over the tensor, context and expert axes carry the activations
  every layer waits for and sit on the critical path.
- **offload**: the state kept in host memory crosses the host link (PCIe) in and out each step.

A pipeline's bubble and accumulation's microbatches are in the program itself (its loops' FLOPs).

Example:
    >>> compiled = jax.jit(lambda x: (x @ x.T).sum()).lower(jnp.ones((256, 256))).compile()
    >>> timed = step_time(compiled, px.Hardware("h100"), dtype="fp32")
    >>> timed.flops >= 2 * 256**3, 0 < timed.seconds < 1e-3
    (True, True)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from parallax import inspect
from parallax.pricing.cost import KINDS, DeviceSpeeds, program_costs
from parallax.pricing.fused_bytes import dot_flops, fused_bytes
from parallax.pricing.hardware import Hardware

__all__ = ["StepTime", "jaxpr_costs", "lower_bound", "speeds", "step_time"]

_RING = {"all-gather": 1.0, "reduce-scatter": 1.0, "all-to-all": 1.0, "all-reduce": 2.0}


@dataclasses.dataclass(frozen=True)
class StepTime:
    """One step's predicted time on a hardware, per device, and what it is made of.

    Attributes:
        seconds: the step: ``max(compute + memory, overlapped) + exposed + offload``.
        compute: seconds of FLOPs at the dense peak.
        memory: seconds of bytes accessed at the memory bandwidth.
        exposed: seconds of collectives on the critical path (tensor, context, expert axes).
        overlapped: seconds of collectives that run beside the computation (data, FSDP, stages).
        offload: seconds of host-memory transfers.
        flops: FLOPs per device per step.
        bytes_accessed: device-memory bytes per device per step.
        source: how compute and memory were priced: ``"roofline"`` (the compiled program's FLOPs and
            bytes) or ``"roofline, from the jaxpr"`` (planned on other devices than the hardware's).
        peak_flops: the dense peak used, FLOP/s.
    """

    seconds: float
    compute: float
    memory: float
    exposed: float
    overlapped: float
    offload: float
    flops: float
    bytes_accessed: float
    source: str
    peak_flops: float

    @property
    def mfu(self) -> float:
        """The program's FLOPs per second over the peak (with remat, hardware FLOPs: recomputation counts)."""
        return self.flops / self.seconds / self.peak_flops if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "mfu": self.mfu}


def _axes_of(group: Sequence[int], shape: tuple[int, ...]) -> set[int]:
    """The mesh dims (indices) along which a device group's positions differ."""
    coords = np.array(np.unravel_index(np.asarray(group, dtype=np.int64), shape)).T
    return {dim for dim in range(len(shape)) if len(set(coords[:, dim].tolist())) > 1}


def collective_seconds(text: str, hardware: Hardware, mesh_shape: dict[str, int] | None = None,
                       critical_axes: Sequence[str] = (), hosts: Sequence[int] | None = None) -> tuple[float, float]:
    """``(exposed, overlapped)`` seconds of the program's collectives on ``hardware``'s links.

    Args:
        text: the compiled program's text.
        hardware: the accelerator.
        mesh_shape: the mesh's axis sizes in order (positions in a group are its ``devices.flat``).
        critical_axes: the mesh axes whose collectives sit on the critical path.
        hosts: the fast domain of each position; all in one where ``None``.
    """
    shape = tuple((mesh_shape or {}).values()) or (1,)
    names = tuple((mesh_shape or {}).keys())
    count = int(np.prod(shape))
    exposed = overlapped = 0.0
    for kind, runs, moved, groups in inspect.collective_groups(text, count):
        size = max((len(g) for g in groups), default=count) if groups else count
        if size <= 1:
            continue
        across = hosts is not None and any(len({hosts[i] for i in g}) > 1 for g in groups)
        bandwidth, latency = ((hardware.inter_bandwidth, hardware.inter_latency_us) if across
                              else (hardware.intra_bandwidth, hardware.intra_latency_us))
        share = _RING.get(kind, 0.0) * (size - 1) / size if kind in _RING else 1.0  # a permute sends it all
        seconds = runs * latency * 1e-6 + moved * share / bandwidth
        axes = set().union(*(_axes_of(g, shape) for g in groups)) if groups and names else set()
        if any(names[a] in critical_axes for a in axes) or kind == "all-to-all":
            exposed += seconds
        else:
            overlapped += seconds
    return exposed, overlapped


def step_time(compiled: Any, hardware: Hardware, *, dtype: str = "fp32", mesh_shape: dict[str, int] | None = None,
              critical_axes: Sequence[str] = (), hosts: Sequence[int] | None = None, host_bytes: int = 0,
              backend: str | None = None, jaxpr: Any = None, state_shapes: Sequence[tuple[int, ...]] = (),
              state_fraction: float = 1.0) -> StepTime:
    """The predicted time of one step of ``compiled`` on ``hardware`` (see the module).

    Args:
        compiled: the step, a ``jax.stages.Compiled`` (for this backend or the target's).
        hardware: the accelerator (:class:`parallax.Hardware`).
        dtype: the matmuls' compute dtype (``"bf16"`` under ``precision="bf16"``, else ``"fp32"``).
        mesh_shape: the step's mesh, axis name to size, in order.
        critical_axes: the axes whose collectives carry activations (tensor, context, expert).
        hosts: each mesh position's fast domain (host or slice), in ``devices.flat`` order.
        host_bytes: bytes of state kept in host memory (offload), moved in and out each step.
        backend: the platform ``compiled`` runs on (its devices'): where it is not ``hardware``'s kind
            (a GPU planned on CPU devices, a TPU slice compiled without one), FLOPs and bytes are read
            from ``jaxpr``.
        jaxpr: the step's jaxpr: its matmuls' FLOPs (every iteration of its loops: the compilers' cost
            analyses count a loop's body once) and its bytes as a GPU or TPU compiler fuses them
            (:func:`parallax.pricing.fused_bytes.fused_bytes`); values at global shapes split over the
            devices, the state's by ``state_fraction`` (its leaves' shapes are ``state_shapes``), a
            ``shard_map`` body's as they are.
        state_fraction: the train state's bytes per device over its global bytes.
    """
    text = compiled.as_text()
    flops, accessed = program_costs(compiled, text)
    peak = hardware.peak_flops(dtype)
    source = "roofline"
    if jaxpr is not None and backend != hardware.kind:  # not this hardware's own program: read the jaxpr
        devices = int(np.prod(list((mesh_shape or {"": 1}).values())))
        read_flops, accessed = jaxpr_costs(jaxpr, devices, state_shapes, state_fraction)
        flops = max(flops, read_flops)
        source = "roofline, from the jaxpr"
    compute = flops / peak
    memory = accessed / (hardware.memory_tbps * 1e12)
    exposed, overlapped = collective_seconds(text, hardware, mesh_shape, critical_axes, hosts)
    offload = _offload_seconds(hardware, host_bytes)
    seconds = max(compute + memory, overlapped) + exposed + offload
    return StepTime(seconds=seconds, compute=compute, memory=memory, exposed=exposed, overlapped=overlapped,
                    offload=offload, flops=flops, bytes_accessed=accessed, source=source, peak_flops=peak)


def jaxpr_costs(jaxpr: Any, devices: int, state_shapes: Sequence[tuple[int, ...]] = (),
                state_fraction: float = 1.0) -> tuple[float, float]:
    """``(flops, bytes)`` per device of a step's ``jaxpr`` split over ``devices``: every loop
    iteration's matmuls (a compiler's cost analysis counts a loop's body once, the TPU's too), and
    the bytes as a GPU or TPU compiler fuses them (see :func:`step_time`'s ``jaxpr``)."""
    whole, local = dot_flops(jaxpr)
    return whole / devices + local, fused_bytes(jaxpr, state_shapes).per_device(devices, state_fraction)


def lower_bound(jaxpr: Any, hardware: Hardware, *, dtype: str, devices: int,
                state_shapes: Sequence[tuple[int, ...]] = (), state_fraction: float = 1.0,
                host_bytes: int = 0) -> float:
    """Seconds the step of ``jaxpr`` takes at least on ``hardware``, read before anything compiles: its
    compute and memory terms and its offload transfers, which :func:`step_time` reads from the same
    jaxpr for a program compiled on other devices than the hardware's, and to which it only adds (the
    collectives that exceed the computation, those on the critical path; FLOPs the program has beyond the
    jaxpr's). A plan compiles its candidates in the order of this bound and stops where the next one is
    no less than the runner-up's predicted step (:func:`parallax.plan.auto.in_bound_order`).

    Example:
        >>> jaxpr = jax.make_jaxpr(lambda x: (x @ x.T).sum())(jnp.ones((256, 256))).jaxpr
        >>> compiled = jax.jit(lambda x: (x @ x.T).sum()).lower(jnp.ones((256, 256))).compile()
        >>> h100 = px.Hardware("h100")
        >>> bound = lower_bound(jaxpr, h100, dtype="fp32", devices=1)
        >>> 0 < bound <= step_time(compiled, h100, dtype="fp32", jaxpr=jaxpr, backend="cpu").seconds
        True
    """
    flops, accessed = jaxpr_costs(jaxpr, devices, state_shapes, state_fraction)
    return (flops / hardware.peak_flops(dtype) + accessed / (hardware.memory_tbps * 1e12)
            + _offload_seconds(hardware, host_bytes))


def _offload_seconds(hardware: Hardware, host_bytes: int) -> float:
    """Seconds ``host_bytes`` of offloaded state take in and out over the host link each step."""
    return 2 * host_bytes / (hardware.host_link_gbps * 1e9 / 8)


def speeds(hardware: Hardware, dtype: str = "fp32") -> DeviceSpeeds:
    """``hardware``'s figures as the compile-path cost model's :class:`DeviceSpeeds` (for ranking
    the paths of a step compiled for a target whose devices are not in hand)."""
    per_byte = 1 / hardware.intra_bandwidth
    latency = hardware.intra_latency_us * 1e-6
    return DeviceSpeeds(key=f"hardware:{hardware.name}:{dtype}", seconds_per_flop=1 / hardware.peak_flops(dtype),
                        seconds_per_byte=1 / (hardware.memory_tbps * 1e12),
                        seconds_per_layout_byte=2 / (hardware.memory_tbps * 1e12),
                        collectives={kind: (latency, _RING.get(kind, 1.0) * per_byte) for kind in KINDS})
