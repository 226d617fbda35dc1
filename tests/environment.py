"""The XLA options the suite compiles with, and the environment of the processes it starts.

Compiling was most of the suite's time (76% of its in-process CPU), and the suite's programs are
tiny: what it checks is what they compute, not how fast. So it asks XLA's CPU backend for its
cheapest code generation (LLVM at -O0; on jaxlib 0.10 also the element-wise emitters instead of
the MLIR fusion pipeline). No conclusion changes: every comparison is between programs compiled
alike in one run (a strategy against a plain one-device loop), and both stacks pass with them, as
do the equivalence tests under ``--xla_cpu_max_isa=AVX2`` and ``SSE4_2`` (tests/README.md at 5b4d645). Run
with ``PARALLAX_TEST_XLA_FLAGS=`` (empty) to compile as a user's run does.
"""

from __future__ import annotations

import os
import re
from importlib.metadata import version

# Measured on a sample of the suite's programs (tests/README.md at 5b4d645), tracing and compiling them: 2.8x
# faster on jaxlib 0.10 with both options (XLA's own compile 5.2x), 1.8x with -O0 alone; jaxlib
# 0.12 has no MLIR-emitter switch (an unknown flag aborts XLA), and -O0 alone gives it 1.7x.
_FAST_COMPILE = {"0.10": "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"}
_FAST_COMPILE_NEWER = "--xla_backend_optimization_level=0"
_DEVICE_COUNT = re.compile(r"--xla_force_host_platform_device_count=\S*")


def compile_flags() -> str:
    """The suite's XLA options for the installed jaxlib: ``PARALLAX_TEST_XLA_FLAGS`` where set
    (empty: XLA's defaults)."""
    if "PARALLAX_TEST_XLA_FLAGS" in os.environ:
        return os.environ["PARALLAX_TEST_XLA_FLAGS"]
    minor = ".".join(version("jaxlib").split(".")[:2])
    return _FAST_COMPILE.get(minor, _FAST_COMPILE_NEWER)


def child_env(devices: int | None = None, **extra: str) -> dict[str, str]:
    """This process's environment for a process the suite starts: the same XLA options without
    this process's simulated device count (``devices`` sets one), no ``JAX_PLATFORMS``."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    flags = _DEVICE_COUNT.sub("", env.pop("XLA_FLAGS", "")).split()
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    env.update(extra)
    return env
