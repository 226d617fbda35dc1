"""A pytest plugin for testing sharded training on CPU: ``pytest_plugins = ["parallax.pytest_plugin"]``.

It gives the ``parallax_devices`` fixture: eight simulated CPU devices
(:func:`parallax.testing.fake_devices`), so a test can check a strategy on a laptop or in CI
with no accelerator. Devices can only be added before JAX starts; if something in the test
session starts JAX first, call ``px.testing.fake_devices(8)`` at the top of ``conftest.py``.
"""

from __future__ import annotations

import jax
import pytest

from parallax.testing import fake_devices


@pytest.fixture(scope="session")
def parallax_devices() -> list[jax.Device]:
    """Eight (simulated CPU) devices for sharded tests, e.g. ``strategy.make_mesh(parallax_devices)``."""
    return fake_devices(8)
