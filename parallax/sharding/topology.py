"""Which devices share a host, and a mesh laid out so that the busiest axes stay inside one.

On a cluster the links inside a host (NVLink, ICI) are 10-50x faster than those between hosts
(InfiniBand, Ethernet, DCN). A mesh axis whose device groups all lie inside a host moves its
bytes over the fast links; an axis whose groups span hosts moves them over the slow ones. So
parallax lays a strategy's axes out by what they move per step, most first, from the inside
out: tensor parallelism (activations at every layer), then FSDP (the params gathered forward
and backward, the gradients reduce-scattered), then data parallelism (one all-reduce of the
gradients), then pipeline stages (activations once per stage and microbatch), whatever order
the parts were combined in. The mesh keeps the user's axis order for names and specs; only which devices
form each axis's groups changes.

A host is a process (``jax.process_index()``; a slice where JAX reports ``slice_index``).
:class:`Topology` describes hosts that are not this run's: to plan a cluster from one
process (``px.plan(..., topology=px.Topology(hosts=16, devices_per_host=8))``) or to lay out
simulated devices as if they were several hosts.

Example:
    >>> topology = px.Topology(hosts=2, devices_per_host=4)
    >>> mesh = px.combine(px.TensorParallel(4), px.FSDP(2)).make_mesh(topology=topology)
    >>> [[d.id for d in row] for row in mesh.devices]  # each tensor group inside one host
    [[0, 4], [1, 5], [2, 6], [3, 7]]
    >>> crossing_axes(mesh, topology)
    ('fsdp',)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

__all__ = ["Topology", "crossing_axes", "describe_hosts", "host_crossing", "hosts_of", "place_by_topology",
           "spans_hosts"]


@dataclasses.dataclass(frozen=True)
class Topology:
    """Hosts of equal device counts, and optionally the bandwidth of the links inside and between them.

    Attributes:
        hosts: how many hosts (processes, or slices) the devices span.
        devices_per_host: devices in each host.
        host_bandwidth: bytes per second of a link between two devices of one host, if known
            (for pricing; measured by calibration where the devices are this run's).
        cross_host_bandwidth: bytes per second between two hosts, if known.

    Example:
        >>> px.Topology(hosts=16, devices_per_host=8).devices
        128
    """

    hosts: int
    devices_per_host: int
    host_bandwidth: float | None = None
    cross_host_bandwidth: float | None = None

    def __post_init__(self):
        for name in ("hosts", "devices_per_host"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"Topology({name}={value!r}): give a positive int, e.g. "
                                 "px.Topology(hosts=2, devices_per_host=4).")
        for name in ("host_bandwidth", "cross_host_bandwidth"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"Topology({name}={value!r}): give bytes per second (a positive number), or None.")

    @property
    def devices(self) -> int:
        """Devices in all hosts."""
        return self.hosts * self.devices_per_host

    @classmethod
    def of(cls, devices: Sequence[jax.Device] | None = None) -> Topology:
        """The hosts ``devices`` (all of ``jax.devices()`` by default) really span: one per
        process (per slice and process where JAX reports slices).

        Example:
            >>> px.Topology.of()  # one process: one host
            Topology(hosts=1, devices_per_host=8, host_bandwidth=None, cross_host_bandwidth=None)
        """
        devices = list(jax.devices() if devices is None else devices)
        counts: dict = {}
        for device in devices:
            counts[_host_key(device)] = counts.get(_host_key(device), 0) + 1
        sizes = sorted(set(counts.values()))
        if len(sizes) > 1:
            raise ValueError(f"The devices span hosts of unequal device counts ({dict(sorted(counts.items()))} per "
                             "(slice, process)); give the same number of devices of each process.")
        return cls(hosts=len(counts), devices_per_host=sizes[0])


def _host_key(device: jax.Device) -> tuple[int, int]:
    return int(getattr(device, "slice_index", 0) or 0), int(device.process_index)


def hosts_of(devices: Sequence[jax.Device], topology: Topology | None = None) -> np.ndarray:
    """The host of each device, in the order given (``0 .. hosts - 1``).

    Devices of several processes belong to their process's host (``topology``, if given, must
    agree). Devices of one process given a ``topology`` of several hosts are that many hosts
    as simulated: ordered by id, the first ``devices_per_host`` are host 0, and so on.

    Example:
        >>> hosts_of(jax.devices(), px.Topology(hosts=2, devices_per_host=4)).tolist()
        [0, 0, 0, 0, 1, 1, 1, 1]
    """
    devices = list(devices)
    keys = sorted({_host_key(d) for d in devices})  # (slice, process) of each host, in order
    if topology is None or (len(keys) > 1 and topology.hosts == len(keys)):
        index = {key: i for i, key in enumerate(keys)}
        hosts = np.array([index[_host_key(d)] for d in devices])
    elif len(keys) > 1:
        raise ValueError(f"The devices span {len(keys)} processes but the topology says {topology.hosts} hosts "
                         f"({topology}); leave topology out to use the processes, or give hosts={len(keys)}.")
    else:
        if topology.devices != len(devices):
            raise ValueError(f"{topology} describes {topology.devices} devices but {len(devices)} were given; "
                             f"give hosts × devices_per_host = {len(devices)}.")
        rank = {d.id: i for i, d in enumerate(sorted(devices, key=lambda d: d.id))}
        hosts = np.array([rank[d.id] // topology.devices_per_host for d in devices])
    return hosts


def spans_hosts(devices: Sequence[jax.Device], topology: Topology | None = None) -> bool:
    """Whether ``devices`` lie on more than one host (:func:`hosts_of`).

    Example:
        >>> spans_hosts(jax.devices()), spans_hosts(jax.devices(), px.Topology(2, 4))
        (False, True)
    """
    return len(set(hosts_of(list(devices), topology).tolist())) > 1


def place_by_topology(axes: Sequence[tuple[str, int]], devices: Sequence[jax.Device], inside_first: Sequence[str],
                      topology: Topology | None = None) -> np.ndarray | None:
    """The device grid (shape: the sizes of ``axes``, in their order) whose axes named first in
    ``inside_first`` vary fastest inside a host; ``None`` when the devices are one host.

    Args:
        axes: ``(name, size)`` of the mesh's axes, in mesh order, sizes resolved.
        devices: the devices, of every host.
        inside_first: every axis name, the one that should stay inside a host most first.
        topology: hosts as simulated (see :func:`hosts_of`); the processes by default.
    """
    devices = list(devices)
    if not spans_hosts(devices, topology):
        return None
    hosts = hosts_of(devices, topology)
    names = [name for name, _ in axes]
    sizes = dict(axes)
    by_host = [d for _, _, d in sorted(((int(h), d.id, d) for h, d in zip(hosts, devices)), key=lambda t: t[:2])]
    outside_in = list(reversed(list(inside_first)))  # the physical order, slowest-varying first
    grid = np.asarray(by_host, dtype=object).reshape([sizes[name] for name in outside_in])
    return grid.transpose([outside_in.index(name) for name in names])


def crossing_axes(mesh: jax.sharding.Mesh, topology: Topology | None = None) -> tuple[str, ...]:
    """The axes of ``mesh`` (of more than one device) some of whose device groups span hosts.

    Example:
        >>> crossing_axes(px.FSDP().make_mesh())  # one process
        ()
    """
    devices = list(mesh.devices.flat)
    hosts = hosts_of(devices, topology).reshape(mesh.devices.shape)
    crossing = []
    for index, name in enumerate(mesh.axis_names):
        along = np.moveaxis(hosts, index, -1).reshape(-1, hosts.shape[index])
        if hosts.shape[index] > 1 and any(len(set(row.tolist())) > 1 for row in along):
            crossing.append(name)
    return tuple(crossing)


def describe_hosts(mesh: jax.sharding.Mesh, topology: Topology | None = None) -> str | None:
    """One line: over how many hosts ``mesh`` lies, which axes stay inside a host and which cross
    them, and each host's devices; ``None`` on one host.

    Example:
        >>> mesh = px.combine(px.TensorParallel(4), px.FSDP(2)).make_mesh(topology=px.Topology(2, 4))
        >>> print(describe_hosts(mesh, px.Topology(2, 4)))
        over 2 hosts: 'tensor' inside each host, 'fsdp' across; host 0: devices 0-3, host 1: devices 4-7
    """
    devices = list(mesh.devices.flat)
    if not spans_hosts(devices, topology):
        return None
    hosts = hosts_of(devices, topology)
    crossing = crossing_axes(mesh, topology)
    inside = [a for a in mesh.axis_names if a not in crossing and mesh.shape[a] > 1]
    held = {}
    for host, device in zip(hosts.tolist(), devices):
        held.setdefault(host, []).append(device.id)
    spans = ", ".join(f"host {h}: devices {_ranges(sorted(ids))}" for h, ids in sorted(held.items()))
    return (f"over {len(held)} hosts: {', '.join(repr(a) for a in inside) or 'no axis'} inside each host, "
            f"{', '.join(repr(a) for a in crossing) or 'none'} across; {spans}")


def _ranges(ids: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2, 5"``."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def host_crossing(strategy, mesh: jax.sharding.Mesh, topology: Topology | None = None) -> str | None:
    """A sentence for a mesh (a user's) whose tensor or FSDP axis spans hosts where the strategy's
    own layout of the same devices (its ``make_mesh``, in the kinds' order) keeps it inside one and
    lets a less busy axis cross instead; ``None`` otherwise (one host included).

    Example:
        >>> strategy = px.combine(px.TensorParallel(4), px.FSDP(2))
        >>> topology = px.Topology(hosts=2, devices_per_host=4)
        >>> print(host_crossing(strategy, jax.make_mesh((4, 2), ("tensor", "fsdp")), topology))  # doctest: +ELLIPSIS
        The mesh's axis 'tensor' (size 4) spans hosts: ... strategy.make_mesh() keeps 'tensor' inside each host and lets 'fsdp' cross: ...
    """  # noqa: E501 (a doctest's output)
    devices = list(mesh.devices.flat)
    if not spans_hosts(devices, topology):
        return None
    rank = {part.axis: part.link_rank for part in strategy.parts}
    crossing, placed = crossing_axes(mesh, topology), crossing_axes(strategy.make_mesh(devices, topology), topology)
    worse = [axis for axis in crossing if axis not in placed and rank.get(axis, 50) <= 20
             and rank.get(axis, 50) < min((rank.get(a, 50) for a in placed), default=99)]
    if not worse:
        return None
    axis = min(worse, key=lambda a: rank[a])
    instead = f"lets {' and '.join(repr(a) for a in placed)} cross" if placed else "crosses none"
    return (f"The mesh's axis {axis!r} (size {mesh.shape[axis]}) spans hosts: its collectives, among the busiest "
            f"of the step, run over the slow links between hosts. strategy.make_mesh() keeps {axis!r} inside each "
            f"host and {instead}: leave mesh= out (parallax lays the axes out by host), or pass "
            f"mesh=strategy.make_mesh(devices) for {strategy.describe()}, or order your mesh's devices so that each "
            f"{axis!r} group lies in one process.")
