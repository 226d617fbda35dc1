"""Eight fake CPU devices and the suite's XLA options (``tests/environment.py``), set before JAX
starts its backend."""

import os
import tempfile

from tests.environment import compile_flags

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), compile_flags(), "--xla_force_host_platform_device_count=8"]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for every process the session's workers start: the fault
# runs, launches and examples compile the same programs again and again (the fault suite alone
# ran in 64 s without it, 37 s with it). Keyed by JAX version, flags and devices. The workers
# themselves compile without it: their programs are seldom compiled twice, and writing each one
# to the cache cost a fifth more than compiling it at -O0 (tests/README.md).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), f"parallax-tests-jax-cache-{os.getuid()}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_threefry_partitionable", True)
jax.config.update("jax_enable_compilation_cache", False)  # this process only: its children inherit the variables

pytest_plugins = ["parallax.pytest_plugin"]  # the parallax_devices fixture users get (tests/test_testing.py)

_STACK = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint")


def pytest_sessionstart(session):
    """Says which stack this run tests, first, whatever the verbosity."""
    import platform
    from importlib.metadata import version

    line = (f"stack: Python {platform.python_version()}, " + ", ".join(f"{name} {version(name)}" for name in _STACK)
            + f"; XLA options: {compile_flags() or 'the defaults'}")
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(line)
    else:
        print(line)


def pytest_terminal_summary(terminalreporter):
    """Prints the fault suite's ``faults survived k/n`` line (also from xdist workers) and the tests
    over their time budget."""
    reports = [report for outcome in ("passed", "failed", "skipped", "error", "")
               for report in terminalreporter.stats.get(outcome, []) if hasattr(report, "duration")]
    for nodeid, seconds, budget in over_budget(reports):
        terminalreporter.write_line(f"over budget: {nodeid} took {seconds:.0f} s (budget {budget:.0f} s; "
                                    "tests/README.md)")
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


# The per-test budget (tests/README.md): a test's cold wall time, setup included, under 30 s on two
# cores, unless marked ``@pytest.mark.budget(seconds, why)``. Timers are never asserted (a shared
# machine is noisy): the run's summary lists what went over, so a growing test is seen.
BUDGET_SECONDS = 30.0


def pytest_configure(config):
    config.addinivalue_line("markers", "budget(seconds, why): this test may take up to `seconds` cold, because `why`")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Each report carries its test's budget (xdist passes ``user_properties`` to the controller)."""
    report = yield
    marker = item.get_closest_marker("budget")
    if marker is not None and (not marker.args or not (marker.kwargs.get("why") or marker.args[1:])):
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.budget(seconds, why) needs both")
    report.user_properties.append(("budget_seconds", float(marker.args[0]) if marker else BUDGET_SECONDS))
    return report


def over_budget(reports) -> list[tuple[str, float, float]]:
    """(test, seconds, budget) for each test whose setup, call and teardown took longer than its budget."""
    spent, budget = {}, {}
    for report in reports:
        spent[report.nodeid] = spent.get(report.nodeid, 0.0) + report.duration
        budget.update({report.nodeid: value for name, value in report.user_properties if name == "budget_seconds"})
    return sorted(((nodeid, seconds, budget.get(nodeid, BUDGET_SECONDS)) for nodeid, seconds in spent.items()
                   if seconds > budget.get(nodeid, BUDGET_SECONDS)), key=lambda row: -row[1])
