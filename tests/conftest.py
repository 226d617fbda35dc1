"""Eight fake CPU devices and the suite's XLA options (``tests/environment.py``), set before JAX
starts its backend."""

import gc
import os
import tempfile

from tests.environment import compile_flags

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), compile_flags(), "--xla_force_host_platform_device_count=8"]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the session's workers and every process they start: the
# fault runs, launches and examples compile the same programs again and again (the fault suite
# alone ran in 64 s without it, 37 s with it), and so do the workers, whose tests build the same
# model, strategy and step in new jit objects (test_trainer.py and test_step.py: 175 s of CPU
# without it, 136 s with it, starting empty). Keyed by JAX version, flags and devices; it starts
# empty in a fresh checkout's run (cold), and tests that read what the compiler reports while
# compiling bypass it (the ``fresh_compiles`` fixture).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), f"parallax-tests-jax-cache-{os.getuid()}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax
import pytest

jax.config.update("jax_threefry_partitionable", True)

# Tracing and compiling allocate millions of short-lived objects; with CPython's default thresholds
# the cyclic collector ran every 700 allocations and, in full, over every module and compiled
# program the worker had kept: 5.7 of test_equivalence.py's 150 s, 0.6 s after this
# (tests/README.md). What is imported stays out of its sight, and it runs a hundred times less often.
gc.collect()
gc.freeze()
gc.set_threshold(70_000, 20, 20)

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


@pytest.hookimpl(trylast=True)  # after the slowest tests' list
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


# Each file's cold seconds in each tier's run, summed over its tests (two workers, jax 0.10.2: the whole suite at
# 5b4d645, the core tier at 4634ed6; tests/README.md), so that xdist starts the long files first
# (``--no-loadscope-reorder`` in the Makefile keeps this order): its own order, the files with the most tests first,
# left the one-test files that start processes (faults, docs pages, benchmarks) to run last, alone. Files not listed
# go last.
FILE_SECONDS = {
    "all": {
        "test_docs_pages.py": 487, "test_multiprocess.py": 409, "test_pipeline.py": 410, "test_equivalence.py": 192,
        "test_context_parallel.py": 175, "test_offload.py": 134, "test_expert_parallel.py": 134, "test_auto.py": 128,
        "test_third_party.py": 128, "test_nnx.py": 121, "test_examples.py": 116, "test_faults.py": 109,
        "test_zoo.py": 103, "test_your_mesh.py": 100, "test_user_objects.py": 100, "test_prng.py": 60,
        "test_plan.py": 95, "test_step.py": 83, "test_trainer.py": 79,
        "test_microbatches.py": 70, "test_hardware.py": 142, "test_batch_pins.py": 25, "test_list_scan.py": 55,
        "test_benchmarks.py": 66, "test_resharding.py": 66, "test_testing.py": 64, "test_losses.py": 61,
        "test_grain.py": 54, "test_fsdp.py": 50, "test_docs.py": 43, "test_per_example_proof.py": 42,
        "test_topology.py": 40, "test_elastic.py": 28, "test_tp_layout.py": 27, "test_model_habits.py": 17,
        "test_distribution.py": 11, "test_figures.py": 7, "test_architecture.py": 6, "test_api.py": 5,
        "test_errors.py": 3, "test_specs.py": 1, "test_compat.py": 1,
    },
    # The tests marked launch, by file (in the whole suite's run).
    "launch": {"test_multiprocess.py": 409, "test_docs_pages.py": 26, "test_grain.py": 15},
    # the newest stack only (`make test-latest`; jax 0.12, warm: the whole file in one worker)
    "libraries": {"test_model_libraries.py": 230},
    "core": {
        "test_pipeline.py": 128, "test_context_parallel.py": 84, "test_step.py": 70, "test_expert_parallel.py": 67,
        "test_microbatches.py": 70, "test_hardware.py": 62, "test_batch_pins.py": 25, "test_list_scan.py": 35,
        "test_testing.py": 61, "test_nnx.py": 60, "test_plan.py": 55, "test_trainer.py": 45, "test_your_mesh.py": 44,
        "test_prng.py": 25, "test_user_objects.py": 20,
        "test_equivalence.py": 42, "test_offload.py": 37, "test_third_party.py": 34, "test_per_example_proof.py": 28,
        "test_docs.py": 25, "test_auto.py": 25, "test_losses.py": 21, "test_elastic.py": 17,
        "test_model_habits.py": 15, "test_tp_layout.py": 14, "test_zoo.py": 13, "test_grain.py": 13,
        "test_distribution.py": 12, "test_fsdp.py": 11, "test_topology.py": 10, "test_figures.py": 8,
        "test_architecture.py": 6, "test_api.py": 4, "test_errors.py": 2, "test_specs.py": 1, "test_compat.py": 1,
        "test_resharding.py": 0, "test_docs_pages.py": 0,
    },
}


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
    config.addinivalue_line("markers", "core: the core tier, what `make test` runs (tests/README.md)")
    config.addinivalue_line("markers", "wide(why): the wide tier, which `make test-all` adds, because `why`")
    config.addinivalue_line("markers", "launch: starts several jax.distributed processes (`make test-latest` "
                                       "runs these beside the core tier)")
    config.addinivalue_line("markers", "libraries: trains a model library's own model (MaxText, Tunix), installed on "
                                       "the newest stack only (`make test-latest` runs these whatever their tier)")


# The two tiers (tests/README.md). Every test declares its tier: a file's ``pytestmark`` (``pytest.mark.core``
# or ``pytest.mark.wide(why)``), which a test or a parameter overrides with the other marker; the closest wins.
TIERS = ("core", "wide")
SELECTIONS = {"core", "wide", "launch", "libraries", "all"}


def pytest_addoption(parser):
    parser.addoption("--tier", default="all", metavar="core|wide|all[,launch]",
                     help="the tiers to run, a comma-separated union: core (`make test`), wide, all (`make "
                          "test-all`), launch (the tests marked launch, whatever their tier), libraries (the tests "
                          "marked libraries, whatever their tier: `make test-latest` runs core,launch,libraries). "
                          "Default: all")


def tier_of(item) -> str:
    """The tier a test declares: the closest ``core`` or ``wide`` marker (a parameter's, the test's, its class's,
    its file's); a ``wide`` marker must say why."""
    for marker in item.iter_markers():
        if marker.name == "wide" and not (marker.args or marker.kwargs.get("why")):
            raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.wide(why) needs its reason")
        if marker.name in TIERS:
            return marker.name
    raise pytest.UsageError(f"{item.nodeid} declares no tier: give its file `pytestmark = pytest.mark.core` or "
                            "`pytest.mark.wide(why)` (tests/README.md: the tiers)")


def check_budget(item, tier: str) -> None:
    """A core test is held to the 30 s budget: over it, it moves to the wide tier or gets smaller."""
    marker = item.get_closest_marker("budget")
    if tier == "core" and marker is not None and marker.args and float(marker.args[0]) > BUDGET_SECONDS:
        raise pytest.UsageError(f"{item.nodeid}: a core test may not take {marker.args[0]} s (the core tier's "
                                f"budget is {BUDGET_SECONDS:.0f} s): make it smaller or move it to the wide tier, the "
                                "reason in its pytest.mark.wide(why)")


def selected(item, chosen: set[str]) -> bool:
    """Whether the union of tiers ``chosen`` holds ``item``."""
    marked = any(name in chosen and item.get_closest_marker(name) is not None for name in ("launch", "libraries"))
    return "all" in chosen or tier_of(item) in chosen or marked


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Keeps the tiers ``--tier`` names (every test's tier checked first), the longest files first."""
    chosen = {name.strip() for name in config.getoption("--tier").split(",") if name.strip()}
    if not chosen or chosen - SELECTIONS:
        raise pytest.UsageError(f"--tier={config.getoption('--tier')!r}: choose from {sorted(SELECTIONS)}, "
                                "comma-separated (e.g. --tier core,launch)")
    for item in items:
        check_budget(item, tier_of(item))
    kept = [item for item in items if selected(item, chosen)]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if not selected(item, chosen)])
    # Each file's cold seconds in the tiers run (a stable sort: each file's tests keep their order).
    if chosen & {"all", "wide"}:
        seconds = FILE_SECONDS["all"]
    else:
        extra = {name: seconds for marker in ("launch", "libraries") if marker in chosen
                 for name, seconds in FILE_SECONDS.get(marker, {}).items()}
        seconds = {name: FILE_SECONDS["core"].get(name, 0) + extra.get(name, 0)
                   for name in {*FILE_SECONDS["core"], *extra}}
    items[:] = sorted(kept, key=lambda item: -seconds.get(item.path.name, 0))


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
        for name, value in report.user_properties:
            if name == "budget_seconds":
                budget[report.nodeid] = value
    return sorted(((nodeid, seconds, budget.get(nodeid, BUDGET_SECONDS)) for nodeid, seconds in spent.items()
                   if seconds > budget.get(nodeid, BUDGET_SECONDS)), key=lambda row: -row[1])
