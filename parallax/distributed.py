"""Several processes (one per host): start JAX's multi-controller runtime the way parallax needs it.

Call :func:`initialize` first thing in the training script, on every host, before any other
JAX call. It starts ``jax.distributed`` from explicit arguments, from ``PARALLAX_*``
environment variables (what ``python -m parallax.launch`` sets), or from what JAX detects
(SLURM, Open MPI, Kubernetes, Cloud TPU), and configures it so that no process waits forever:

* a process that dies (killed, out of memory) stops sending heartbeats; after
  ``heartbeat_timeout`` seconds JAX's coordination service ends every other process;
* a process whose script raises prints its traceback and exits at once (``fail_fast``)
  instead of waiting at JAX's shutdown barrier for processes that are themselves waiting
  for it in a collective; the others then end as above;
* a process that ends normally while others still run waits ``shutdown_timeout`` seconds
  for them at the shutdown barrier, then every process ends.

Example:
    >>> processes = px.distributed.initialize()  # a single process: nothing to start
    >>> processes.count, processes.index
    (1, 0)
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

import jax

log = logging.getLogger("parallax")

ENV_COORDINATOR = "PARALLAX_COORDINATOR"
ENV_NUM_PROCESSES = "PARALLAX_NUM_PROCESSES"
ENV_PROCESS_ID = "PARALLAX_PROCESS_ID"


@dataclasses.dataclass(frozen=True)
class Processes:
    """The processes of this run, as this process sees them.

    Attributes:
        index: this process's index (0 is the one that prints and writes logs).
        count: how many processes train together.
        local_devices: this process's devices.
        devices: the devices of all processes together.
        device_kind: the kind of device (the same on every process).
    """

    index: int
    count: int
    local_devices: int
    devices: int
    device_kind: str


def _started() -> bool:
    from jax._src import distributed as jax_distributed
    return jax_distributed.global_state.client is not None


def _backend_started() -> bool:
    from jax._src import xla_bridge
    return xla_bridge.backends_are_initialized()


def _cluster_detected() -> bool:
    """Whether JAX would find a cluster (SLURM, Open MPI, Kubernetes, Cloud TPU) to start from."""
    from jax._src import clusters
    try:
        return any(cluster.is_env_present() for cluster in clusters.ClusterEnv._cluster_types
                   if not getattr(cluster, "opt_in_only_method", None))
    except Exception:  # a private API: if it moved, JAX's own initialize decides
        return False


def _from_env(value: Any, name: str, kind: type) -> Any:
    if value is not None or not os.environ.get(name):
        return value
    try:
        return kind(os.environ[name])
    except ValueError:
        raise ValueError(f"${name}={os.environ[name]!r} is not a valid {kind.__name__}.") from None


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, local_device_ids: Sequence[int] | None = None,
               heartbeat_timeout: int = 10, shutdown_timeout: int = 30, initialization_timeout: int = 300,
               fail_fast: bool = True) -> Processes:
    """Starts ``jax.distributed`` for a multi-process run (nothing in a single process).

    Args:
        coordinator_address: ``host:port`` of process 0's coordination service; else
            ``$PARALLAX_COORDINATOR``, ``$JAX_COORDINATOR_ADDRESS`` or what JAX detects.
        num_processes: how many processes; else ``$PARALLAX_NUM_PROCESSES`` or detected.
        process_id: this process's index; else ``$PARALLAX_PROCESS_ID`` or detected.
        local_device_ids: the local devices this process uses (JAX's default: all).
        heartbeat_timeout: seconds without a heartbeat after which a process counts as dead
            and every other process is ended (JAX's default is 100).
        shutdown_timeout: seconds a process that finished waits for the others at exit.
        initialization_timeout: seconds to wait for every process to connect.
        fail_fast: an uncaught exception exits its process at once, after its traceback.

    Returns:
        :class:`Processes`. Calling again once started returns the same without restarting;
        with no coordinator given or detected, a single process (nothing is started).

    Raises:
        RuntimeError: JAX's backend already started in this process (call this first).
        ValueError: processes disagree on their number of local devices or their kind.
    """
    coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR) or None
    num_processes = _from_env(num_processes, ENV_NUM_PROCESSES, int)
    process_id = _from_env(process_id, ENV_PROCESS_ID, int)
    given = (coordinator_address, num_processes, process_id, os.environ.get("JAX_COORDINATOR_ADDRESS"))
    starting = not _started() and (any(v is not None for v in given) or _cluster_detected())
    if starting:
        if _backend_started():
            raise RuntimeError(
                "parallax.distributed.initialize() must run before any other JAX call: this process has already "
                "started JAX's backend (jax.devices(), an array, a jit call...). Call it first thing in the script, "
                "right after the imports."
            )
        jax.distributed.initialize(
            coordinator_address, num_processes, process_id, local_device_ids=local_device_ids,
            heartbeat_timeout_seconds=heartbeat_timeout, shutdown_timeout_seconds=shutdown_timeout,
            initialization_timeout=initialization_timeout)
    processes = _processes()
    _check_devices()
    if fail_fast and processes.count > 1:
        # Started elsewhere, JAX's own heartbeat timeout (100 s by default) applies, not ours.
        sys.excepthook = _exit_at_once(sys.excepthook, processes, heartbeat_timeout if starting else None)
    log.info("Process %d of %d: %d local devices, %d in all.", processes.index, processes.count,
             processes.local_devices, processes.devices)
    return processes


def _processes() -> Processes:
    return Processes(index=jax.process_index(), count=jax.process_count(), local_devices=jax.local_device_count(),
                     devices=jax.device_count(), device_kind=jax.local_devices()[0].device_kind)


def _check_devices() -> None:
    """Raises on every process when processes hold different numbers or kinds of devices
    (read from the global device list: no collective, which such processes could not run)."""
    held: dict[int, list] = {}
    for device in jax.devices():
        held.setdefault(device.process_index, []).append(device.device_kind)
    found = {index: (len(kinds), sorted(set(kinds))) for index, kinds in sorted(held.items())}
    first = found[min(found)]
    for index, (count, kinds) in found.items():
        if (count, kinds) != first:
            raise ValueError(
                f"Processes hold different devices: process {min(found)} has {first[0]} x {', '.join(first[1])}, "
                f"process {index} has {count} x {', '.join(kinds)}. Start every process with the same number and "
                "kind of devices (e.g. CUDA_VISIBLE_DEVICES, --xla_force_host_platform_device_count).")


def _exit_at_once(previous: Any, processes: Processes, heartbeat_timeout: int | None) -> Any:
    """An excepthook that prints the traceback as ``previous`` does, then ends the process."""
    if getattr(previous, "parallax_fail_fast", False):
        return previous

    within = f"heartbeat_timeout={heartbeat_timeout}s" if heartbeat_timeout is not None else "JAX's heartbeat timeout"

    def hook(kind, value, traceback):
        previous(kind, value, traceback)
        sys.stderr.write(f"parallax: process {processes.index} of {processes.count} failed with {kind.__name__}; it "
                         f"exits now; the other processes end within seconds where it failed inside Trainer.fit, "
                         f"else within {within}.\n")
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        logging.shutdown()
        os._exit(1)  # not through JAX's shutdown barrier, where the others will never arrive

    hook.parallax_fail_fast = True
    return hook
