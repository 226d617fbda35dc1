"""Eight fake CPU devices, set before JAX starts its backend."""

import os
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the session's workers and every process they start:
# the fault runs, launches and examples compile the same programs again and again (the fault
# suite alone ran in 64 s without it, 37 s with it). Keyed by JAX version, flags and devices.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), f"parallax-tests-jax-cache-{os.getuid()}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

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


@pytest.fixture
def fresh_compiles():
    """Compiles within the test bypass the persistent compilation cache: the compiler reports
    what it did (an involuntary resharding) only when it really compiles a program."""
    from jax._src import compilation_cache

    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_enable_compilation_cache", before)
    compilation_cache.reset_cache()
