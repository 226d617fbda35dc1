"""What a plan's step is compiled for: a TPU slice or GPUs, compiled deviceless by their own compilers.

With ``libtpu`` installed (``pip install 'parallax-flax[tpu]'``), ``jax.experimental.topologies``
describes a TPU slice of any size on a machine without one: a mesh over its abstract devices
compiles with the TPU compiler itself, whose ``memory_analysis()`` and ``cost_analysis()`` are
the target's (MaxText's ``train_compile.py`` and AXLearn's AOT compilation work so). A plan for a
TPU hardware runs in a subprocess (the TPU compiler stays out of the caller's process).

With JAX's CUDA plugin installed (``pip install 'parallax-flax[gpu]'``: ``jax[cuda12-local]``, the
plugin without the CUDA libraries, which a compile without a GPU does not load), a GPU is described
to XLA's GPU compiler by a target config (``GpuTargetConfigProto``: its SMs, shared memory, L2,
memory, compute capability; the figures of XLA's own ``backends/gpu/target_config/specs``), and
``jax.experimental.topologies`` gives hosts of such GPUs to compile for: the plan's peak is then the
GPU compiler's (without autotuning, which needs the device). Without the plugin a GPU's step is
compiled for CPU devices, which fuse less: an estimate, and the report says so.

Example:
    >>> slice_shape(px.Hardware("v5p"), 512), slice_shape(px.Hardware("v6e"), 256)
    ('8x8x8', '16x16')
"""

from __future__ import annotations

import importlib.util
from typing import Any

from parallax._errors import first_line
from parallax.pricing.hardware import Hardware

__all__ = ["GPU_TARGETS", "check_target", "cuda_plugin_installed", "deviceless", "gpu_devices", "gpu_target_config",
           "libtpu_installed", "slice_shape", "tpu_devices"]

_THREE_D = ("v4", "v5p")  # 3D tori; v5e and v6e slices are 2D


def libtpu_installed() -> bool:
    """Whether the TPU compiler (the ``libtpu`` package) is importable here."""
    return importlib.util.find_spec("libtpu") is not None


# What XLA's GPU compiler is told of each named GPU (xla/backends/gpu/target_config/specs/*.txtpb in
# openxla/xla: h100_sxm, h200, a100_sxm_80, b200); the memory's size and bandwidth come from the Hardware.
_HOPPER = dict(core_count=132, fpus_per_core=128, shared_memory_per_core=233472, shared_memory_per_block_optin=232448,
               l2_cache_size=52428800, clock_rate_ghz=1.98, compute_capability=(9, 0))  # H100 SXM and H200 alike
GPU_TARGETS: dict[str, dict[str, Any]] = {
    "h100": _HOPPER,
    "h200": _HOPPER,
    "a100": dict(core_count=108, fpus_per_core=64, shared_memory_per_core=167936, shared_memory_per_block_optin=166912,
                 l2_cache_size=41943040, clock_rate_ghz=1.41, compute_capability=(8, 0)),
    "b200": dict(core_count=148, fpus_per_core=128, shared_memory_per_core=233472, shared_memory_per_block_optin=232448,
                 l2_cache_size=132644864, clock_rate_ghz=1.965, compute_capability=(10, 0)),
}


def cuda_plugin_installed() -> bool:
    """Whether JAX's CUDA plugin (``jax[cuda12-local]`` or ``jax[cuda13-local]``) is importable here."""
    if importlib.util.find_spec("jax_plugins") is None:  # no plugin at all: its namespace package is missing
        return False
    return any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") is not None for v in (12, 13))


def gpu_target_config(hardware: Hardware) -> str | None:
    """``hardware`` described to XLA's GPU compiler (a ``GpuTargetConfigProto`` in text form), or
    ``None`` for a GPU it has no figures for (a custom one).

    Example:
        >>> print(gpu_target_config(px.Hardware("h200")).splitlines()[14])
          device_memory_size: 151397597184
    """
    spec = GPU_TARGETS.get(hardware.name) if hardware.kind == "gpu" else None
    if spec is None:
        return None
    major, minor = spec["compute_capability"]
    return "\n".join([
        "gpu_device_info {", "  threads_per_block_limit: 1024", "  threads_per_warp: 32",
        "  shared_memory_per_block: 49152", f"  shared_memory_per_core: {spec['shared_memory_per_core']}",
        "  threads_per_core_limit: 2048", f"  core_count: {spec['core_count']}",
        f"  fpus_per_core: {spec['fpus_per_core']}", "  block_dim_limit_x: 2147483647", "  block_dim_limit_y: 65535",
        "  block_dim_limit_z: 65535", f"  memory_bandwidth: {int(hardware.memory_tbps * 1e12)}",
        f"  l2_cache_size: {spec['l2_cache_size']}", f"  clock_rate_ghz: {spec['clock_rate_ghz']}",
        f"  device_memory_size: {hardware.memory_bytes}",
        f"  shared_memory_per_block_optin: {spec['shared_memory_per_block_optin']}",
        f"  cuda_compute_capability {{ major: {major} minor: {minor} }}",
        "  registers_per_core_limit: 65536", "  registers_per_block_limit: 65536", "}",
        "runtime_version { major: 12 minor: 8 }", 'platform_name: "CUDA"', "dnn_version_info { major: 9 minor: 10 }",
        f'device_description_str: "{hardware.device_kind or hardware.name}"', ""])


def deviceless(hardware: Hardware | None) -> bool:
    """Whether a plan for ``hardware`` compiles with its own compiler here, without its devices: a
    TPU (with libtpu, else :func:`check_target` refuses), or a named GPU with JAX's CUDA plugin."""
    if hardware is None:
        return False
    if hardware.kind == "tpu":
        return True
    return gpu_target_config(hardware) is not None and cuda_plugin_installed()


def gpu_devices(hardware: Hardware, devices: int) -> list[Any]:
    """The abstract devices of ``devices`` GPUs of ``hardware``, ``devices_per_host`` to a host, for
    XLA's GPU compiler (nothing runs on them)."""
    from jax.experimental import topologies

    per_host = min(devices, hardware.devices_per_host)
    try:
        described = topologies.get_topology_desc("parallax", "cuda", target_config=gpu_target_config(hardware),
                                                 topology=f"1x{devices // per_host}x{per_host}")
    except Exception as err:
        raise ValueError(f"XLA's GPU compiler cannot describe {devices} {hardware.name} devices "
                         f"({devices // per_host} hosts of {per_host}): "
                         f"{first_line(err)}") from None
    return list(described.devices)


def slice_shape(hardware: Hardware, devices: int) -> str:
    """The slice's chip grid for ``devices`` chips (``"8x8x8"``): a power of two, grown by doubling
    its shortest side, as Google Cloud's standard slice shapes are."""
    if devices < 1 or devices & (devices - 1):
        raise ValueError(f"devices={devices} on {hardware.name}: a TPU slice has a power-of-two number of chips "
                         f"(e.g. {1 << max(devices.bit_length() - 1, 0)} or {1 << devices.bit_length()}).")
    dims = [1, 1, 1] if hardware.tpu_name in _THREE_D else [1, 1]
    while dims[0] * dims[1] * (dims[2] if len(dims) == 3 else 1) < devices:
        shortest = min(range(len(dims)), key=lambda i: (dims[i], -i if len(dims) == 3 else i))
        dims[shortest] *= 2
    ordered = sorted(dims)
    ordered = [d for d in ordered if d > 1] + [d for d in ordered if d == 1]  # 2x2x1, as Google names it
    return "x".join(str(d) for d in ordered)


def check_target(hardware: Hardware | None, devices: int) -> None:
    """Refuses, before anything compiles, a TPU plan the TPU compiler cannot make here."""
    if hardware is None or hardware.kind != "tpu":
        return
    if not hardware.tpu_name:
        raise ValueError(f"Hardware({hardware.name!r}) is a TPU without tpu_name (the TPU compiler's name for its "
                         "generation, e.g. tpu_name='v5p'); give it.")
    if not libtpu_installed():
        raise ValueError(f"hardware={hardware.name!r} is a TPU: its plan is compiled by the TPU compiler, which "
                         "comes with libtpu: pip install 'parallax-flax[tpu]' (or pip install 'libtpu==0.0.42.*' "
                         "for jax 0.10). Without it, plan the same step on simulated CPU devices: "
                         "px.plan(..., devices=N, target='tpu').")
    slice_shape(hardware, devices)


def tpu_devices(hardware: Hardware, devices: int) -> list[Any]:
    """The abstract devices of a ``devices``-chip slice of ``hardware`` (one per chip)."""
    from jax.experimental import topologies

    per_slice = hardware.domain(devices)  # beyond a pod: several slices over the data-center network
    shape = slice_shape(hardware, per_slice)
    options = {"chip_config_name": "megacore"} if hardware.tpu_name == "v4" else {}  # one device per chip
    if devices > per_slice:
        options["num_slices"] = devices // per_slice
    try:
        described = topologies.get_topology_desc(platform="tpu", topology_name=f"{hardware.tpu_name}:{shape}",
                                                 **options)
    except Exception as err:
        raise ValueError(f"The TPU compiler cannot describe {hardware.tpu_name} slices {shape} ({devices} chips): "
                         f"{first_line(err)}") from None
    found = list(described.devices)
    if len(found) != devices:
        raise ValueError(f"The TPU compiler describes {hardware.tpu_name}:{shape} as {len(found)} devices, not "
                         f"{devices}; give Hardware({hardware.name!r}, fast_domain=...) or another count.")
    return found
