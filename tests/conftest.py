"""Eight fake CPU devices, set before JAX starts its backend."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_threefry_partitionable", True)

pytest_plugins = ["parallax.pytest_plugin"]  # the parallax_devices fixture users get (tests/test_testing.py)

_STACK = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint")


def pytest_sessionstart(session):
    """Says which stack this run tests, first, whatever the verbosity."""
    import platform
    from importlib.metadata import version

    line = f"stack: Python {platform.python_version()}, " + ", ".join(f"{name} {version(name)}" for name in _STACK)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(line)
    else:
        print(line)


def pytest_terminal_summary(terminalreporter):
    """Prints the fault suite's ``faults survived k/n`` line (also from xdist workers)."""
    for outcome in ("passed", "failed"):
        for report in terminalreporter.stats.get(outcome, []):
            for name, value in getattr(report, "user_properties", ()):
                if name == "faults_survived" and getattr(report, "when", "call") == "call":
                    terminalreporter.write_line(f"faults survived {value}")
