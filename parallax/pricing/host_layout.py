"""Which layout of a strategy's axes over hosts moves the fewest bytes across them, read from one
compiled step.

A compiled SPMD program is the same whichever devices fill a mesh of its shape: only which
devices form each collective's groups changes. So the step compiled once on any layout tells,
for every order in which the axes could be laid out from the inside of a host out
(:func:`parallax.sharding.topology.place_by_topology`), the bytes its collectives would move
between hosts. The kinds' order (tensor, FSDP, data, stages:
:meth:`parallax.sharding.strategy.Strategy.inside_first`) is the guess made before anything
compiles; what moves the fewest bytes across hosts is what the Trainer and ``px.plan`` lay out.
Links inside a host are 10-50x faster than those between hosts, so the bytes across them are
what a layout is priced by.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from parallax import inspect
from parallax.sharding.mesh import build_mesh
from parallax.sharding.strategy import Strategy
from parallax.sharding.topology import Topology, hosts_of, spans_hosts


@dataclasses.dataclass(frozen=True)
class HostLayout:
    """A layout of the mesh's axes over hosts, priced.

    Attributes:
        mesh: the mesh laid out so (the strategy's axis order; its devices placed by host).
        inside_first: the axis names, the one kept inside a host most first.
        across: bytes per device per step its collectives move between hosts.
        kinds_order_across: the same for the kinds' order (what ``strategy.make_mesh()`` lays out).
        priced: the bytes across hosts of every order tried, keyed by the order.
        seconds: where the topology gives both links' bandwidths, the seconds per step its
            collective bytes take on them (inside a host and across), by which it was chosen.
    """

    mesh: Mesh
    inside_first: tuple[str, ...]
    across: int
    kinds_order_across: int
    priced: dict = dataclasses.field(default_factory=dict)
    seconds: float | None = None

    def describe(self) -> str:
        """One line: which axes stay inside a host, and the bytes across hosts against the kinds' order."""
        crossing = [a for a in self.inside_first if self.mesh.shape[a] > 1]
        inside = ", ".join(repr(a) for a in crossing[:-1]) or "nothing"
        saved = (f"; the kinds' order would move {self.kinds_order_across:,} B"
                 if self.kinds_order_across != self.across else "")
        return (f"Laid out over hosts by measured bytes: {inside} inside each host first, {crossing[-1]!r} "
                f"outermost ({self.across:,} B per device per step across hosts{saved}).")


def orders(strategy: Strategy, mesh: Mesh) -> list[tuple[str, ...]]:
    """The inside-first orders worth pricing: every order of the axes of more than one device (the
    kinds' order first), the axes of one device after them."""
    kinds = strategy.inside_first()
    busy = [a for a in kinds if mesh.shape[a] > 1]
    idle = tuple(a for a in kinds if mesh.shape[a] == 1)
    return [tuple(order) + idle for order in itertools.permutations(busy)]


def cheapest_layout(hlo_text: str, strategy: Strategy, mesh: Mesh, topology: Topology | None = None,
                    allowed: Callable[[Mesh], bool] | None = None) -> HostLayout | None:
    """The layout of ``mesh``'s devices over hosts whose collectives move the fewest bytes across
    hosts, from the step compiled on ``mesh`` (``hlo_text``); ``None`` on one host.

    Args:
        hlo_text: the step compiled on ``mesh`` (any layout of its shape).
        strategy: the strategy whose axes ``mesh`` has.
        mesh: the mesh the step was compiled on.
        topology: the hosts as simulated (:class:`parallax.Topology`); the processes by default.
        allowed: only layouts whose mesh it accepts (e.g. where each process's part of an
            iterable still fits the batch's layout); all by default.

    Layouts are ranked by the bytes they move across hosts; where ``topology`` gives both links'
    bandwidths, by the seconds their bytes take on them (inside ÷ ``host_bandwidth`` + across ÷
    ``cross_host_bandwidth``). Ties go to the kinds' order (the first tried).
    """
    devices = list(mesh.devices.flat)
    if not spans_hosts(devices, topology):
        return None
    collectives = inspect.collective_groups(hlo_text, len(devices))
    total = sum(moved for _, _, moved, _ in collectives)
    axes = [(name, int(mesh.shape[name])) for name in mesh.axis_names]
    tried = orders(strategy, mesh)  # the kinds' order first
    best, priced = None, {}
    for order in tried:
        candidate = build_mesh(axes, devices, order, topology)
        across = priced[order] = inspect.across_bytes(collectives, hosts_of(list(candidate.devices.flat), topology))
        cost = link_seconds(total - across, across, topology)
        cost = across if cost is None else cost
        if (allowed is None or allowed(candidate)) and (best is None or cost < best[2]):
            best = (candidate, order, cost)
    if best is None:  # none allowed: the kinds' order
        best = (build_mesh(axes, devices, tried[0], topology), tried[0], None)
    candidate, order = best[:2]
    return HostLayout(candidate, order, priced[order], priced[tried[0]], priced,
                      link_seconds(total - priced[order], priced[order], topology))


def link_seconds(inside: int, across: int, topology: Topology | None) -> float | None:
    """Seconds per step of ``inside`` and ``across`` bytes on the topology's links; ``None`` where it
    does not give both bandwidths.

    Example:
        >>> link_seconds(900e9, 50e9, px.Topology(2, 8, host_bandwidth=900e9, cross_host_bandwidth=50e9))
        2.0
    """
    if topology is None or topology.host_bandwidth is None or topology.cross_host_bandwidth is None:
        return None
    return inside / topology.host_bandwidth + across / topology.cross_host_bandwidth


def laid_out_by_bytes(compile_step: Callable[[Mesh], Any], strategy: Strategy, devices: Sequence[jax.Device],
                      topology: Topology | None = None,
                      allowed: Callable[[Mesh], bool] | None = None) -> HostLayout | None:
    """Compiles the step once on the kinds' layout (``compile_step(mesh)`` returns the compiled
    program) and returns :func:`cheapest_layout`; ``None`` where the devices are one host or at
    most one axis has more than one device (then every layout is the same)."""
    devices = list(devices)
    if not spans_hosts(devices, topology):
        return None
    mesh = strategy.make_mesh(devices, topology)
    if sum(size > 1 for size in mesh.shape.values()) < 2:
        return None
    return cheapest_layout(compile_step(mesh).as_text(), strategy, mesh, topology, allowed)
