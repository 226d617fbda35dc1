"""Named accelerators: what one device computes, holds and moves, from the vendors' data sheets.

A :class:`Hardware` is what the planner prices a compiled step on when the devices are not in
hand (``px.plan(..., hardware="h100", devices=256)``): peak dense FLOP/s per compute dtype, the
memory and its bandwidth, the devices per host, and the links inside a host (NVLink, a TPU
slice's ICI) and between hosts (InfiniBand/RoCE, a TPU pod's data-center network), each with a
latency. The profiles are the data sheets' figures (``docs/reference/hardware.md`` cites each);
the latencies are typical collective start-up times, not data-sheet figures. Every field can be
overridden, and a custom accelerator is a full set of fields.

Example:
    >>> px.Hardware("h100").peak_flops("bf16")
    989000000000000.0
    >>> px.Hardware("h100", inter_host_gbps=200).inter_host_gbps
    200
    >>> px.Hardware("h100").topology(256)
    Topology(hosts=32, devices_per_host=8, host_bandwidth=450000000000.0, cross_host_bandwidth=50000000000.0)
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping, Sequence
from typing import Any

from parallax.sharding.topology import Topology

__all__ = ["PROFILES", "Hardware", "known"]

# Data sheets (dense figures: the sparse ones are twice these): NVIDIA H100/H200 (Hopper),
# A100 (Ampere), HGX/DGX B200 (Blackwell); Google Cloud TPU v4, v5e, v5p, v6e system architecture
# pages. Link speeds per device and direction: NVLink 4 is 900 GB/s both ways (450 GB/s each way),
# NVLink 5 1.8 TB/s; one ConnectX-7 400 Gb/s NIC per GPU in DGX/HGX H100, H200, B200 (200 Gb/s HDR
# in DGX A100). A TPU slice's ICI is its fast network (between hosts too); hosts of different
# slices talk over the data-center network (DCN). "fp32" is what float32 matmuls run at under
# JAX's default precision: TF32 on NVIDIA tensor cores, bf16 passes on TPUs.
_NVIDIA = "https://www.nvidia.com/en-us/data-center/"
_TPU = "https://cloud.google.com/tpu/docs/"
PROFILES: dict[str, dict[str, Any]] = {
    "h100": dict(kind="gpu", device_kind="NVIDIA H100 80GB HBM3",
                 peak_tflops={"bf16": 989, "fp16": 989, "fp32": 494, "fp8": 1979},
                 memory_gib=80, memory_tbps=3.35, devices_per_host=8, fast_domain=8, intra_host_gbps=3600,
                 inter_host_gbps=400, host_link_gbps=512, sources=(_NVIDIA + "h100/",)),
    "h200": dict(kind="gpu", device_kind="NVIDIA H200",
                 peak_tflops={"bf16": 989, "fp16": 989, "fp32": 494, "fp8": 1979},
                 memory_gib=141, memory_tbps=4.8, devices_per_host=8, fast_domain=8, intra_host_gbps=3600,
                 inter_host_gbps=400, host_link_gbps=512, sources=(_NVIDIA + "h200/",)),
    "a100": dict(kind="gpu", device_kind="NVIDIA A100-SXM4-80GB", peak_tflops={"bf16": 312, "fp16": 312, "fp32": 156},
                 memory_gib=80, memory_tbps=2.039, devices_per_host=8, fast_domain=8, intra_host_gbps=2400,
                 inter_host_gbps=200, host_link_gbps=256, sources=(_NVIDIA + "a100/",)),
    "b200": dict(kind="gpu", device_kind="NVIDIA B200",
                 peak_tflops={"bf16": 2250, "fp16": 2250, "fp32": 1100, "fp8": 4500},
                 memory_gib=180, memory_tbps=8.0, devices_per_host=8, fast_domain=8, intra_host_gbps=7200,
                 inter_host_gbps=400, host_link_gbps=512, sources=(_NVIDIA + "dgx-b200/",)),
    "v4": dict(kind="tpu", device_kind="TPU v4", peak_tflops={"bf16": 275, "fp32": 275},
               memory_gib=32, memory_tbps=1.2, devices_per_host=4, fast_domain=4096, intra_host_gbps=2400,
               inter_host_gbps=100, host_link_gbps=256, tpu_name="v4", sources=(_TPU + "v4",)),
    "v5e": dict(kind="tpu", device_kind="TPU v5 lite", peak_tflops={"bf16": 197, "fp32": 197},
                memory_gib=16, memory_tbps=0.819, devices_per_host=4, fast_domain=256, intra_host_gbps=1600,
                inter_host_gbps=25, host_link_gbps=256, tpu_name="v5e", sources=(_TPU + "v5e",)),
    "v5p": dict(kind="tpu", device_kind="TPU v5", peak_tflops={"bf16": 459, "fp32": 459, "fp8": 459},
                memory_gib=95, memory_tbps=2.765, devices_per_host=4, fast_domain=8960, intra_host_gbps=4800,
                inter_host_gbps=50, host_link_gbps=256, tpu_name="v5p", sources=(_TPU + "v5p",)),
    "v6e": dict(kind="tpu", device_kind="TPU v6 lite", peak_tflops={"bf16": 918, "fp32": 918},
                memory_gib=32, memory_tbps=1.638, devices_per_host=4, fast_domain=256, intra_host_gbps=3200,
                inter_host_gbps=100, host_link_gbps=512, tpu_name="v6e", sources=(_TPU + "v6e",)),
}
_ALIASES = {"h100-sxm": "h100", "h100sxm": "h100", "a100-80gb": "a100", "a100-sxm": "a100", "tpu-v4": "v4",
            "tpu-v5e": "v5e", "v5litepod": "v5e", "tpu-v5p": "v5p", "tpu-v6e": "v6e", "trillium": "v6e"}
_REQUIRED = ("kind", "peak_tflops", "memory_gib", "memory_tbps", "devices_per_host", "intra_host_gbps",
             "inter_host_gbps")
_LATENCY_US = {"gpu": (10.0, 20.0), "tpu": (5.0, 30.0)}  # a collective's start-up inside the fast network / across


def known() -> list[str]:
    """The names of the built-in profiles."""
    return sorted(PROFILES)


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator as the planner prices it: a built-in profile by name, any field overridden,
    or a custom one (a new name with every required field).

    Attributes:
        name: a profile (:func:`known`: ``"h100"``, ``"h200"``, ``"a100"``, ``"b200"``, ``"v4"``,
            ``"v5e"``, ``"v5p"``, ``"v6e"``) or a new name for a custom accelerator.
        kind: ``"gpu"`` or ``"tpu"`` (what the step is compiled for).
        peak_tflops: dense peak TFLOP/s per compute dtype (``"bf16"``, ``"fp32"``, ``"fp8"``...);
            an override is merged into the profile's.
        memory_gib: device memory, GiB.
        memory_tbps: device memory bandwidth, TB/s.
        devices_per_host: accelerators per host (per process of a run).
        fast_domain: devices one fast network joins (a host's NVLink, a TPU slice's ICI); the
            devices per host by default, and a GPU's follows ``devices_per_host`` where only that is
            overridden (``Hardware("h100", devices_per_host=4)``: NVLink joins 4).
        intra_host_gbps: the fast links, Gb/s per device and direction (NVLink; a TPU's ICI).
        inter_host_gbps: between hosts (fast domains), Gb/s per device and direction (the NIC;
            a TPU's data-center network).
        host_link_gbps: device to host memory (PCIe), Gb/s per direction: offloaded state.
        intra_latency_us: a collective's start-up inside a fast domain, microseconds.
        inter_latency_us: a collective's start-up across them, microseconds.
        device_kind: what JAX calls the device (``jax.devices()[0].device_kind``).
        tpu_name: the TPU generation as the TPU compiler names topologies (``"v5p"``).
        sources: where the figures come from.
    """

    name: str
    kind: str | None = None
    peak_tflops: Mapping[str, float] | None = None
    memory_gib: float | None = None
    memory_tbps: float | None = None
    devices_per_host: int | None = None
    fast_domain: int | None = None
    intra_host_gbps: float | None = None
    inter_host_gbps: float | None = None
    host_link_gbps: float | None = None
    intra_latency_us: float | None = None
    inter_latency_us: float | None = None
    device_kind: str | None = None
    tpu_name: str | None = None
    sources: tuple[str, ...] = ()

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Hardware({self.name!r}): give a name, one of {known()} or a new one with every field.")
        key = _ALIASES.get(self.name.lower(), self.name.lower())
        profile = PROFILES.get(key)
        given = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                 if f.name != "name" and getattr(self, f.name) not in (None, ())}
        if profile is None:
            missing = [name for name in _REQUIRED if name not in given]
            if missing:
                close = difflib.get_close_matches(key, list(PROFILES) + list(_ALIASES), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(f"Hardware({self.name!r}) is not a known accelerator{hint}: known are {known()}. "
                                 f"A custom one needs {', '.join(missing)} too, e.g. Hardware('my-gpu', kind='gpu', "
                                 "peak_tflops={'bf16': 400}, memory_gib=64, memory_tbps=2.0, devices_per_host=8, "
                                 "intra_host_gbps=1600, inter_host_gbps=200).")
            merged = dict(given)
        else:
            merged = {**profile, **given}
            if "devices_per_host" in given and "fast_domain" not in given and profile["fast_domain"] == profile[
                    "devices_per_host"]:  # a GPU's NVLink joins a host's devices: as many as the host now has
                merged["fast_domain"] = given["devices_per_host"]
            object.__setattr__(self, "name", key)
            if "peak_tflops" in given:
                merged["peak_tflops"] = {**profile["peak_tflops"], **given["peak_tflops"]}
        kind = merged.get("kind")
        if kind not in ("gpu", "tpu"):
            raise ValueError(f"Hardware({self.name!r}, kind={kind!r}): give 'gpu' or 'tpu'.")
        merged.setdefault("fast_domain", merged["devices_per_host"])
        merged.setdefault("intra_latency_us", _LATENCY_US[kind][0])
        merged.setdefault("inter_latency_us", _LATENCY_US[kind][1])
        merged.setdefault("host_link_gbps", 256)
        for name, value in merged.items():
            object.__setattr__(self, name, value)
        self._check()

    def _check(self) -> None:
        if not isinstance(self.peak_tflops, Mapping) or not self.peak_tflops:
            raise ValueError(f"Hardware({self.name!r}, peak_tflops={self.peak_tflops!r}): give a dict of dense peak "
                             "TFLOP/s by compute dtype, e.g. {'bf16': 989, 'fp32': 494}.")
        numbers = {f"peak_tflops[{k!r}]": v for k, v in self.peak_tflops.items()}
        numbers.update({name: getattr(self, name) for name in (
            "memory_gib", "memory_tbps", "intra_host_gbps", "inter_host_gbps", "host_link_gbps", "intra_latency_us",
            "inter_latency_us")})
        for name, value in numbers.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"Hardware({self.name!r}, {name}={value!r}): give a positive number.")
        for name in ("devices_per_host", "fast_domain"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Hardware({self.name!r}, {name}={value!r}): give a positive int.")

    # --- what the planner reads ------------------------------------------------------------
    @property
    def memory_bytes(self) -> int:
        """Device memory in bytes."""
        return int(self.memory_gib * 2**30)

    def peak_flops(self, dtype: str = "bf16") -> float:
        """Dense peak FLOP/s for ``dtype`` (``"bf16"``, ``"fp32"``...).

        Example:
            >>> px.Hardware("a100").peak_flops("fp32")  # TF32
            156000000000000.0
        """
        key = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "f32": "fp32"}.get(dtype, dtype)
        if key not in self.peak_tflops:
            raise ValueError(f"Hardware({self.name!r}) has no peak for {dtype!r}: it lists {sorted(self.peak_tflops)} "
                             f"(give it: Hardware({self.name!r}, peak_tflops={{{key!r}: ...}})).")
        return float(self.peak_tflops[key]) * 1e12

    @property
    def intra_bandwidth(self) -> float:
        """Bytes per second per device and direction on the fast links."""
        return self.intra_host_gbps * 1e9 / 8

    @property
    def inter_bandwidth(self) -> float:
        """Bytes per second per device and direction between fast domains."""
        return self.inter_host_gbps * 1e9 / 8

    def domain(self, devices: int) -> int:
        """The devices of one fast domain in a run of ``devices``: a host's (GPUs), a slice's (TPUs)."""
        return min(devices, self.fast_domain)

    def topology(self, devices: int) -> Topology:
        """``devices`` of this hardware as :class:`parallax.Topology`: its hosts, and the bandwidths of
        the links inside a host and between hosts. A TPU slice's hosts are joined by its ICI, as
        fast as inside one; slices (beyond a pod) by the data-center network.

        Example:
            >>> px.Hardware("v5p").topology(512).hosts, px.Hardware("v5p").topology(512).cross_host_bandwidth
            (128, 600000000000.0)
        """
        if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
            raise ValueError(f"devices={devices!r}: give a device count (an int >= 1).")
        for size, unit in ((min(devices, self.devices_per_host), "host"), (self.domain(devices), "slice")):
            if devices % size:
                raise ValueError(f"devices={devices} on {self.name}: a {unit} holds {size} devices, and {devices} is "
                                 f"not a multiple of {size}; give a multiple (e.g. {devices // size * size or size} or "
                                 f"{(devices // size + 1) * size}).")
        per_host = min(devices, self.devices_per_host)
        one_network = self.kind == "tpu" and devices <= self.fast_domain
        return Topology(hosts=devices // per_host, devices_per_host=per_host, host_bandwidth=self.intra_bandwidth,
                        cross_host_bandwidth=self.intra_bandwidth if one_network else self.inter_bandwidth)

    def domains(self, hosts: Sequence[int]) -> list[int]:
        """The fast domain (a GPU's host, a TPU's slice) of each device, from its host index."""
        return [int(host) * self.devices_per_host // self.fast_domain for host in hosts]

    def describe(self) -> str:
        """One line: the figures the plan used."""
        peaks = ", ".join(f"{k} {v:g}" for k, v in sorted(self.peak_tflops.items()))
        return (f"{self.name} ({self.kind}): {peaks} TFLOP/s dense; {self.memory_gib:g} GiB at {self.memory_tbps:g} "
                f"TB/s; {self.intra_host_gbps:g} Gb/s per device inside a {'host' if self.kind == 'gpu' else 'slice'} "
                f"of {self.fast_domain}, {self.inter_host_gbps:g} Gb/s between")


def as_hardware(value: Any) -> Hardware | None:
    """``value`` (a name, a :class:`Hardware`, or ``None``) as a :class:`Hardware`."""
    if value is None or isinstance(value, Hardware):
        return value
    if isinstance(value, str):
        return Hardware(value)
    raise ValueError(f"hardware={value!r}: give a name ({', '.join(known())}) or a px.Hardware(...).")
