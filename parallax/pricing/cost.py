"""A step-time model for compiled programs, from speeds measured on the devices themselves.

``estimate(compiled, speeds)`` prices one compiled step (per device) as

    flops × s/FLOP + bytes accessed × s/byte + transposed bytes × s/byte
    + Σ over collective kinds (count × latency + bytes × s/byte)

with FLOPs and bytes accessed from XLA's ``cost_analysis()`` (plus the matmuls a loop runs
after its first iteration, which it leaves out) and collective bytes by kind from the HLO
(:func:`parallax.inspect.collective_bytes`, the same count the benchmarks and ``px.plan``
report). The speeds come from :func:`calibrate`: a matmul, a memory-bound
elementwise op and each collective kind at two sizes, run on the given devices all at once
(so simulated devices that share cores are measured as they run), fitted to the same terms.
A calibration takes a second or two and is cached per machine, device kind, device count
and JAX version in ``$PARALLAX_CACHE_DIR`` (``~/.cache/parallax`` by default).

Over several hosts the collectives are priced by the links they run over: a collective whose
device groups lie inside a host at the speeds measured inside one, one whose groups span hosts
at the speeds measured between them (:attr:`DeviceSpeeds.cross_host`, calibrated where this
run's devices span processes), or, for hosts a :class:`parallax.Topology` describes with both
bandwidths, at the inside speeds scaled by ``host_bandwidth / cross_host_bandwidth``.

The model ranks candidates of the *same* work (compile paths, FSDP splits, mesh shapes); it
is not a profiler. ``benchmarks/cost_model.py`` measures it against real step times.

Example:
    >>> speeds = calibrate(jax.devices()[:8])
    >>> compiled = jax.jit(lambda x: (x @ x.T).sum()).lower(jnp.ones((256, 256))).compile()
    >>> 0 < estimate(compiled, speeds).seconds < 1
    True
"""

from __future__ import annotations

import dataclasses
import platform
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from parallax import _cache, _multihost, inspect
from parallax._compat import mesh_context, shard_map
from parallax.sharding.topology import Topology, hosts_of, place_by_topology

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_VERSION = 4  # of the cached calibration's fields
CACHE_FILE = "device_speeds.json"


@dataclasses.dataclass(frozen=True)
class DeviceSpeeds:
    """What one device achieves while every device of its group runs.

    Attributes:
        key: what the calibration is for (machine, device kind and count, JAX version).
        seconds_per_flop: of a float32 matmul.
        seconds_per_byte: of memory traffic (an elementwise op).
        seconds_per_layout_byte: of a physical transpose (:func:`parallax.inspect.layout_bytes`).
        collectives: kind -> ``(seconds per op, seconds per byte)``, bytes as
            :func:`parallax.inspect.collective_bytes` counts them.
        overhead: seconds of launching one program.
        calibration_seconds: what measuring took (0 when read from the cache).
        cross_host: where the devices span hosts (processes), kind -> ``(seconds per op, seconds
            per byte)`` of a collective whose groups span them; ``collectives`` then holds those of
            groups inside one host. ``None`` on one host.
    """

    key: str
    seconds_per_flop: float
    seconds_per_byte: float
    seconds_per_layout_byte: float
    collectives: dict[str, tuple[float, float]]
    overhead: float = 0.0
    calibration_seconds: float = 0.0
    cross_host: dict[str, tuple[float, float]] | None = None

    def across(self, topology: Topology | None = None) -> dict[str, tuple[float, float]] | None:
        """The collectives' speeds between hosts: scaled from those inside by ``topology``'s two
        bandwidths where it gives both, else as calibrated (``None`` where neither says).

        Example:
            >>> speeds = DeviceSpeeds("k", 1e-12, 1e-10, 1e-10, {"all-reduce": (1e-5, 1e-9)})
            >>> speeds.across(px.Topology(2, 4, host_bandwidth=100e9, cross_host_bandwidth=25e9))
            {'all-reduce': (1e-05, 4e-09)}
        """
        if topology is not None and topology.host_bandwidth and topology.cross_host_bandwidth:
            slower = topology.host_bandwidth / topology.cross_host_bandwidth
            return {kind: (latency, per_byte * slower) for kind, (latency, per_byte) in self.collectives.items()}
        return self.cross_host


@dataclasses.dataclass(frozen=True)
class Estimate:
    """The predicted time of one step, per device, and what it is made of.

    Attributes:
        seconds: the predicted step time.
        compute: seconds of FLOPs.
        memory: seconds of bytes accessed and of physical transposes.
        collectives: seconds of collectives.
        flops: FLOPs per device (``cost_analysis``).
        bytes_accessed: bytes per device (``cost_analysis``).
        transposed: bytes of physical transposes per device (:func:`parallax.inspect.layout_bytes`).
        moved: collective bytes per device, all kinds.
        peak: arguments + outputs - donated + temporaries (``memory_analysis``).
    """

    seconds: float
    compute: float
    memory: float
    collectives: float
    flops: float
    bytes_accessed: float
    transposed: int
    moved: int
    peak: int

    def describe(self) -> str:
        return (f"{1e3 * self.seconds:.1f} ms (compute {1e3 * self.compute:.1f}, memory {1e3 * self.memory:.1f}, "
                f"collectives {1e3 * self.collectives:.1f} for {self.moved / 2**20:.1f} MiB; "
                f"peak {self.peak / 2**20:.1f} MiB)")


def program_costs(compiled: Any, text: str) -> tuple[float, float]:
    """``(FLOPs, bytes accessed)`` per device of ``compiled`` (its text is ``text``): XLA's
    ``cost_analysis()``, plus the matmuls its loops run after their first iteration, which it leaves
    out (a scanned stack, a pipeline)."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):  # older JAX: one dict per program
        analysis = analysis[0] if analysis else {}
    analysis = analysis or {}
    return (float(analysis.get("flops", 0.0)) + inspect.loop_dot_flops(text),
            float(analysis.get("bytes accessed", 0.0)))


def estimate(compiled: Any, speeds: DeviceSpeeds, devices: Sequence[jax.Device] | None = None,
             topology: Topology | None = None) -> Estimate:
    """The predicted step time of ``compiled`` (a ``jax.stages.Compiled``) on ``speeds``' devices.

    Args:
        compiled: the program.
        speeds: :func:`calibrate`'s.
        devices: the program's devices in its order (its mesh's ``devices.flat``): where they span
            hosts (the processes, or ``topology``'s) and the speeds between hosts are known
            (:meth:`DeviceSpeeds.across`), each collective is priced on the links it runs over.
        topology: the hosts as simulated, with their links' bandwidths (:class:`parallax.Topology`).
    """
    text = compiled.as_text()
    flops, accessed = program_costs(compiled, text)
    transposed = inspect.layout_bytes(text)
    traffic = inspect.collective_bytes(text)
    across = speeds.across(topology) if devices is not None else None
    hosts = hosts_of(list(devices), topology) if across is not None else None
    if hosts is not None and len(set(hosts.tolist())) > 1:
        links = inspect.collective_bytes_by_link(text, hosts)
        priced = [(links["inside"], speeds.collectives), (links["across"], across)]
    else:
        priced = [(traffic, speeds.collectives)]
    collective_s = 0.0
    for stats, kinds in priced:
        for kind, stat in stats.items():
            latency, per_byte = kinds.get(kind, kinds["all-reduce"])
            collective_s += stat.count * latency + stat.bytes * per_byte
    compute = flops * speeds.seconds_per_flop
    memory = accessed * speeds.seconds_per_byte + transposed * speeds.seconds_per_layout_byte
    return Estimate(seconds=speeds.overhead + compute + memory + collective_s, compute=compute, memory=memory,
                    collectives=collective_s, flops=flops, bytes_accessed=accessed, transposed=transposed,
                    moved=sum(stat.bytes for stat in traffic.values()),
                    peak=inspect.peak_bytes(inspect.memory_bytes(compiled)))


# --- calibration -------------------------------------------------------------------------
def device_key(devices: Sequence[jax.Device]) -> str:
    """What a measurement on ``devices`` holds for: the machine, device kind and count, JAX version."""
    first = devices[0]
    hosts = len(set(hosts_of(list(devices)).tolist()))
    return "|".join([platform.node(), first.platform, getattr(first, "device_kind", "?"), str(len(devices)),
                     *([f"{hosts} hosts"] if hosts > 1 else []), f"jax {jax.__version__}", f"v{_VERSION}"])


def _stored(speeds: DeviceSpeeds) -> dict:
    return {"seconds_per_flop": speeds.seconds_per_flop, "seconds_per_byte": speeds.seconds_per_byte,
            "seconds_per_layout_byte": speeds.seconds_per_layout_byte, "overhead": speeds.overhead,
            "collectives": {k: list(v) for k, v in speeds.collectives.items()},
            "calibration_seconds": speeds.calibration_seconds,
            "cross_host": None if speeds.cross_host is None else {k: list(v) for k, v in speeds.cross_host.items()}}


def _from_stored(key: str, stored: dict, calibration_seconds: float = 0.0) -> DeviceSpeeds:
    return DeviceSpeeds(key, stored["seconds_per_flop"], stored["seconds_per_byte"], stored["seconds_per_layout_byte"],
                        {k: tuple(v) for k, v in stored["collectives"].items()}, stored["overhead"],
                        calibration_seconds,
                        None if stored.get("cross_host") is None
                        else {k: tuple(v) for k, v in stored["cross_host"].items()})


def _timed(fn: Any, *args: Any, repeats: int = 5) -> tuple[float, Any]:
    """Median wall time of ``fn(*args)`` after one warm-up call, and the compiled program."""
    compiled = fn.lower(*args).compile()
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times)), compiled


def _two_point(small: tuple[float, float], large: tuple[float, float]) -> tuple[float, float]:
    """``(fixed seconds, seconds per unit)`` of the line through two (units, seconds) points."""
    (u0, t0), (u1, t1) = small, large
    per_unit = max((t1 - t0) / max(u1 - u0, 1.0), t1 / max(u1, 1.0) * 0.05, 1e-15)
    return max(t0 - u0 * per_unit, 0.0), per_unit


def _nonnegative_fit(features: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (few unknowns: every subset of them is tried)."""
    weights = 1.0 / seconds  # relative errors: a 2 ms program counts as much as a 200 ms one
    best, best_error = np.zeros(features.shape[1]), float(len(seconds))
    for mask in range(1, 2 ** features.shape[1]):
        columns = [i for i in range(features.shape[1]) if mask >> i & 1]
        solution = np.linalg.lstsq(features[:, columns] * weights[:, None], seconds * weights, rcond=None)[0]
        if (solution < 0).any():
            continue
        coefficients = np.zeros(features.shape[1])
        coefficients[columns] = solution
        error = float(np.sum(((features @ coefficients - seconds) * weights) ** 2))
        if error < best_error:
            best, best_error = coefficients, error
    return best


def _measure(devices: Sequence[jax.Device]) -> DeviceSpeeds:
    start = time.perf_counter()
    mesh = Mesh(np.array(devices), ("d",))
    with mesh_context(mesh):  # its own mesh, whatever mesh the caller has set (a train step's, a user's)
        return _measure_on(mesh, start)


def _measure_on(mesh: Mesh, start: float) -> DeviceSpeeds:
    devices, n = list(mesh.devices.flat), mesh.size
    rows = NamedSharding(mesh, PartitionSpec("d"))
    whole = NamedSharding(mesh, PartitionSpec())

    # Compute and memory: matmuls, elementwise ops and a transpose of a few sizes on every
    # device at once, fitted to flops x a + bytes x b + c.
    # Beyond 8 devices every size shrinks with the device count: an all-gather's output grows
    # with it on every device (64 simulated devices would otherwise hold GBs).
    # Each input is created in its layout: a whole array made first would sit on every device of
    # the caller's mesh (64 simulated devices x 128 MiB ran a 24 GiB machine out of memory).
    shrink = max(1, n // 8)
    programs = []
    for size in (2**18 // shrink, 2**21 // shrink):
        programs.append((jax.jit(lambda v: v * 1.5 + 0.5), (((n * size,), rows),)))
    for m, k in ((128, 512), (512, 1024)):
        programs.append((jax.jit(lambda a, b: a @ b), (((n * m, k), rows), ((k, k), whole))))
    for m in (256, 1024):
        programs.append((jax.jit(lambda a, m=m: jnp.swapaxes(a.reshape(n, m, 512), 1, 2) + 1.0),
                         (((n * m, 512), rows),)))
    features, seconds = [], []
    for fn, inputs in programs:
        placed = [jnp.ones(shape, jnp.float32, device=sharding) for shape, sharding in inputs]
        elapsed, compiled = _timed(fn, *placed)
        text = compiled.as_text()  # loop-free programs: their costs are cost_analysis()'s
        features.append([*program_costs(compiled, text), inspect.layout_bytes(text), 1.0])
        seconds.append(elapsed)
    seconds_per_flop, seconds_per_byte, per_layout_byte, overhead = _nonnegative_fit(np.array(features),
                                                                                      np.array(seconds))

    hosts = len(set(hosts_of(devices).tolist()))
    grid = (place_by_topology([("host", hosts), ("d", n // hosts)], devices, ("d", "host"))
            if hosts > 1 and n % hosts == 0 and n // hosts > 1 else None)
    if grid is not None:  # over several hosts: each link measured on its own, 'd' inside a host, 'host' across
        grid = Mesh(grid, ("host", "d"))
        collectives, cross_host = _collective_speeds(grid, "d", shrink), _collective_speeds(grid, "host", shrink)
    else:
        collectives, cross_host = _collective_speeds(mesh, "d", shrink), None
    return DeviceSpeeds(device_key(devices), float(seconds_per_flop), float(seconds_per_byte), float(per_layout_byte),
                        collectives,
                        overhead=float(overhead), calibration_seconds=time.perf_counter() - start,
                        cross_host=cross_host)


def _collective_speeds(mesh: Mesh, axis: str, shrink: int) -> dict[str, tuple[float, float]]:
    """Each collective kind over ``axis`` of ``mesh`` (every device taking part), at two sizes,
    as ``(seconds per op, seconds per byte)``."""
    n, size = mesh.size, int(mesh.shape[axis])
    every = PartitionSpec(tuple(mesh.axis_names))
    ops = {
        "all-gather": lambda x: jax.lax.all_gather(x, axis, tiled=True),
        "all-reduce": lambda x: jax.lax.psum(x, axis),
        "reduce-scatter": lambda x: jax.lax.psum_scatter(x, axis, tiled=True),
        "all-to-all": lambda x: jax.lax.all_to_all(x, axis, 0, 0, tiled=True),
        "collective-permute": lambda x: jax.lax.ppermute(x, axis, [(i, (i + 1) % size) for i in range(size)]),
    }
    collectives = {}
    with mesh_context(mesh):
        for kind, op in ops.items():
            points = []
            for elements in (256, max(2**17 // shrink, 2**10)):  # per device: 1 KiB and 512 KiB (up to 8 devices)
                mapped = jax.jit(shard_map(op, mesh=mesh, in_specs=every, out_specs=every,
                                           manual_axes=set(mesh.axis_names)))
                data = jnp.ones((n * elements,), jnp.float32, device=NamedSharding(mesh, every))
                seconds, compiled = _timed(mapped, data)
                moved = sum(stat.bytes for stat in inspect.collective_bytes(compiled.as_text()).values())
                points.append((float(moved), seconds))
            collectives[kind] = _two_point(*points)
    return collectives


def calibrate(devices: Sequence[jax.Device] | None = None, *, refresh: bool = False) -> DeviceSpeeds:
    """The speeds of ``devices`` (all of this process's by default) running together.

    Read from the per-machine cache when it has them; otherwise measured (a second or two)
    and cached. ``refresh=True`` measures again.
    """
    devices = list(devices if devices is not None else jax.devices())
    key = device_key(devices)
    # With several processes, process 0's cache and measurement decide for all: they then
    # compile the same programs, whatever each host's own cache or load.
    found = _multihost.agree(None if refresh else _cache.read(CACHE_FILE).get(key))
    if found:
        return _from_stored(key, found)
    speeds = _measure(devices)  # every process takes part: the programs span all the devices
    if jax.process_count() > 1:
        speeds = _from_stored(key, _multihost.agree(_stored(speeds)), speeds.calibration_seconds)
    # Another process on this machine may have stored its measurement first: this one uses that one
    # too. Several processes of one run use process 0's (agreed above), whatever their hosts hold.
    stored = _stored(speeds)
    kept = _cache.store(CACHE_FILE, key, stored, replace=refresh or jax.process_count() > 1)
    if kept == stored or not isinstance(kept, dict):
        return speeds
    return _from_stored(key, kept)
