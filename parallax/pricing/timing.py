"""Timing the cost model's closest candidates on the devices before committing to one.

The cost model ranks compiled candidates from their programs alone. Where its best estimates
lie close together, the ranking is within the model's error, so ``strategy="auto"``,
``FSDP(split="auto")`` and a train step choosing its compile path run the closest few
(:func:`closest`) for a handful of steps on a freshly built state (or a copy of the caller's)
and the example batch, round by round, and keep the measured fastest where it beats the cost
model's pick by more than :data:`MARGIN` (:func:`settle`): closer than that, a few timed steps
on a shared machine do not tell two plans apart. The programs are the ones already compiled
to price them: timing adds no compile.
The times are cached per machine with the programs' fingerprints (``$PARALLAX_CACHE_DIR``),
so searching the same model again picks the same candidate without running anything.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from parallax import _cache
from parallax._compat import mesh_context
from parallax._errors import first_line
from parallax.pricing.choice import Choice
from parallax.pricing.cost import device_key

log = logging.getLogger("parallax")

WINDOW = 1.25  # candidates estimated within 25% of the best are close enough to time
ROUNDS = 5  # timed steps per candidate, after one untimed warm-up step
CHEAP_SECONDS = 2.0  # timing that costs less (by the estimates) settles every candidate, close or not
CACHE_FILE = "timed_candidates.json"
# The measured fastest replaces the cost model's pick only when faster by more than this. On the
# zoo (benchmarks/results/zoo_pieces.md), 5-round timings 0.3-6% apart overturned the model's pick
# six times, and 25 interleaved rounds then measured the timed pick 1.10-1.33x the best plan.
MARGIN = 0.10
FAMILY_WINDOW = 3.0  # each layout family's best estimated within 3x the pick is timed as well (closest)


@dataclasses.dataclass(frozen=True)
class Timed:
    """One candidate to run: its compiled train step, how to build its state, and its batch.

    Attributes:
        step: ``step(state, batch) -> (state, metrics)``, compiled ahead of time.
        program: its ``jax.stages.Compiled`` program (fingerprinted for the cache).
        build: builds the candidate's sharded train state.
        batch: the example batch, placed as the candidate's step expects it.
        state_bytes: the state's bytes per device.
        peak: the compiled step's estimated peak bytes per device.
    """

    step: Callable[[Any, Any], Any]
    program: Any
    build: Callable[[], Any]
    batch: Any
    state_bytes: int
    peak: int


def closest(choice: Choice, limit: int, families: Mapping[str, Any] | None = None) -> list[str]:
    """The candidates worth timing, fastest estimate first: those that fit the budget and are
    estimated within :data:`WINDOW` of the pick, where the cost model's ranking is within its
    error (at most ``limit`` of them); or, where timing them all would take under
    :data:`CHEAP_SECONDS` of steps (by their estimates), every one that fits: on steps that short
    the model's fixed per-op costs dominate its error (on an 8 ms MLP step it priced two plans
    1.9x apart that measured within 3%), and settling it costs less than compiling the candidates did.

    With ``families`` (label -> its layout family: the model-parallel parts it combines, e.g. tensor
    or expert parallelism), each other family's best that fits and is estimated within
    :data:`FAMILY_WINDOW` of the pick is timed too: the cost model errs by family (on a listed mixture
    of experts it priced expert parallelism 2.9x its measured step and the pick 1.6x, and the expert
    mesh measured fastest), so a whole family is never ruled out by its estimate alone.
    """
    if limit < 2 or choice.picked in choice.over_budget:
        return []
    best = choice.estimates[choice.picked].seconds
    fitting = [label for label in choice.estimates if label not in choice.over_budget]
    cost = (ROUNDS + 1) * sum(choice.estimates[label].seconds for label in fitting[:limit])
    near = fitting[:limit] if cost <= CHEAP_SECONDS else [
        label for label in fitting[:limit] if choice.estimates[label].seconds <= WINDOW * best]
    if families:
        seen = {families.get(label) for label in near} | {families.get(choice.picked)}
        for label in fitting:  # fastest first: the first of each family is its best
            family = families.get(label)
            if family not in seen and choice.estimates[label].seconds <= FAMILY_WINDOW * best:
                near.append(label)
            seen.add(family)
    return near if len(near) > 1 else []


def settle(choice: Choice, timed: Callable[[str], Timed], budget: int | None, limit: int,
           devices: Sequence[jax.Device], families: Mapping[str, Any] | None = None) -> Choice:
    """``choice`` with its close call (:func:`closest`: at most ``limit`` close candidates, and with
    ``families`` each other layout family's best) settled on the devices: the measured fastest picked
    where it beats the cost model's pick by more than :data:`MARGIN` (:func:`measured_pick`), the
    times in :attr:`Choice.timed`.

    ``timed(label)`` makes a candidate ready to run. Nothing runs where there is no close call
    or with several processes (each would time on its own clock and cache); where running fails
    (e.g. out of memory) the cost model's pick stands.
    """
    labels = closest(choice, limit, families)
    if not labels or jax.process_count() > 1:
        return choice
    try:
        times = measure({label: timed(label) for label in labels}, budget, device_key(devices))
    except jax.errors.JaxRuntimeError as err:
        log.info("Timing the closest candidates failed (%s); keeping the cost model's pick.", first_line(err))
        return choice
    return dataclasses.replace(choice, picked=measured_pick(choice.picked, times), timed=times)


def measured_pick(priced: str, times: Mapping[str, float]) -> str:
    """The candidate to take from ``times`` (label -> median seconds): the measured fastest
    where it is faster than the cost model's pick ``priced`` by more than :data:`MARGIN`, else
    ``priced``.

    Example:
        >>> measured_pick("jit", {"jit": 0.0136, "shard_map": 0.0132})  # 3% apart: within noise
        'jit'
        >>> measured_pick("jit", {"jit": 0.0200, "shard_map": 0.0132})
        'shard_map'
    """
    fastest = min(times, key=times.get)
    if priced in times and times[fastest] * (1 + MARGIN) >= times[priced]:
        return priced
    return fastest


def on_mesh(step: Callable[[Any, Any], Any], mesh: Mesh) -> Callable[[Any, Any], Any]:
    """``step`` called with ``mesh`` set, as the Trainer calls it (a model's own sharding
    constraints with bare ``PartitionSpec`` s resolve against it)."""

    def call(state: Any, batch: Any) -> Any:
        with mesh_context(mesh):
            return step(state, batch)

    return call


def measure(candidates: Mapping[str, Timed], budget: int | None, devices_key: str,
            rounds: int = ROUNDS) -> dict[str, float]:
    """Each candidate's median step time in seconds, from the cache when these programs were
    timed on this machine (``devices_key``, see :func:`parallax.pricing.cost.device_key`) before.

    The candidates run round by round (one step each per round) when their states fit the
    budget together, so that a burst of load on a shared machine falls on all of them; else
    one after the other, each state freed before the next is built.
    """
    fingerprint = hashlib.sha256()
    for label, candidate in candidates.items():
        fingerprint.update(f"{label}\n{program_text(candidate.program)}\n".encode())
    key = f"{devices_key}|{rounds}|{fingerprint.hexdigest()}"
    cached = _times_of(_cache.read(CACHE_FILE).get(key), candidates)
    if cached is not None:
        return cached
    times: dict[str, list[float]] = {label: [] for label in candidates}
    together = budget is None or (sum(c.state_bytes for c in candidates.values())
                                  + max(c.peak for c in candidates.values()) <= budget)
    if together:
        states = {label: _warm(c) for label, c in candidates.items()}
        for _ in range(rounds):
            for label, candidate in candidates.items():
                states[label] = _timed(candidate, states[label], times[label])
        del states
    else:
        for label, candidate in candidates.items():
            state = _warm(candidate)
            for _ in range(rounds):
                state = _timed(candidate, state, times[label])
            del state
    medians = {label: statistics.median(seconds) for label, seconds in times.items()}
    kept = _times_of(_cache.store(CACHE_FILE, key, medians), candidates)  # another process's, stored first, wins
    return medians if kept is None else kept


def _times_of(cached: Any, candidates: Mapping[str, Timed]) -> dict[str, float] | None:
    """The cached times of exactly ``candidates``, or ``None`` where the cache holds none."""
    if isinstance(cached, dict) and set(cached) == set(candidates):
        return {label: float(cached[label]) for label in candidates}
    return None


def program_text(program: Any) -> str:
    """A compiled program's HLO without its source metadata: what the devices run, the same
    however the program was reached (the text's stack frames name every caller)."""
    lines = [line for line in program.as_text().splitlines()  # not the file, function and stack frame tables
             if not re.match(r"(\d+ |(FileNames|FunctionNames|FileLocations|StackFrames)$)", line)]
    return re.sub(r", metadata=\{[^{}]*\}", "", "\n".join(lines))


def _warm(candidate: Timed) -> Any:
    state, metrics = candidate.step(candidate.build(), candidate.batch)
    jax.block_until_ready((state, metrics))
    return state


def _timed(candidate: Timed, state: Any, times: list[float]) -> Any:
    start = time.perf_counter()
    state, metrics = candidate.step(state, candidate.batch)
    jax.block_until_ready((state, metrics))
    times.append(time.perf_counter() - start)
    return state
