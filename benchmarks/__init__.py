"""Benchmarks of parallax against hand-written code (``python -m benchmarks.run``)."""

import os


def simulate_cpu_devices(count: int) -> None:
    """Makes JAX start ``count`` simulated CPU devices; call before JAX is imported."""
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
