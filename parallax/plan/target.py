"""What a plan's step is compiled for: a TPU slice compiled deviceless by the TPU compiler.

With ``libtpu`` installed (``pip install 'parallax-flax[tpu]'``), ``jax.experimental.topologies``
describes a TPU slice of any size on a machine without one: a mesh over its abstract devices
compiles with the TPU compiler itself, whose ``memory_analysis()`` and ``cost_analysis()`` are
the target's (MaxText's ``train_compile.py`` and AXLearn's AOT compilation work so). A plan for a
TPU hardware runs in a subprocess (the TPU compiler stays out of the caller's process).

Example:
    >>> slice_shape(px.Hardware("v5p"), 512), slice_shape(px.Hardware("v6e"), 256)
    ('8x8x8', '16x16')
"""

from __future__ import annotations

import importlib.util
from typing import Any

from parallax.pricing.hardware import Hardware

__all__ = ["check_target", "libtpu_installed", "slice_shape", "tpu_devices"]

_THREE_D = ("v4", "v5p")  # 3D tori; v5e and v6e slices are 2D


def libtpu_installed() -> bool:
    """Whether the TPU compiler (the ``libtpu`` package) is importable here."""
    return importlib.util.find_spec("libtpu") is not None


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
    except Exception as err:  # noqa: BLE001 - the TPU compiler's refusal, said in a line
        raise ValueError(f"The TPU compiler cannot describe {hardware.tpu_name} slices {shape} ({devices} chips): "
                         f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from None
    found = list(described.devices)
    if len(found) != devices:
        raise ValueError(f"The TPU compiler describes {hardware.tpu_name}:{shape} as {len(found)} devices, not "
                         f"{devices}; give Hardware({hardware.name!r}, fast_domain=...) or another count.")
    return found
