"""Simulated CPU devices for tests of sharded code on a laptop or in CI."""

from __future__ import annotations

import jax

__all__ = ["fake_devices"]


def fake_devices(count: int = 8) -> list[jax.Device]:
    """Gives this process ``count`` simulated CPU devices, for tests of sharded code on a laptop or CI.

    Call it before anything runs JAX (at the top of ``conftest.py``); it sets
    ``jax_num_cpu_devices`` and selects the CPU backend. If JAX has already started, it
    returns the first ``count`` devices when there are enough, and otherwise raises an error
    saying how to start with more.

    Example:
        >>> len(fake_devices(8))
        8
    """
    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:
        pass  # JAX already started: use what it has
    devices = jax.devices()
    if len(devices) < count:
        raise RuntimeError(
            f"JAX already started with {len(devices)} device(s); fake_devices({count}) must run before anything "
            f"uses JAX (at the top of conftest.py), or start the process with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={count} JAX_PLATFORMS=cpu.")
    return devices[:count]
