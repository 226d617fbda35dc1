"""When a search stops compiling candidates, and the same stop on every run of that search on a machine.

A search prices candidates in order until it has spent its time: ``search_seconds``, or, where
the run's length is known, more than ``steps`` of the best step estimated so far (what the
candidates left could at most save). Both read a clock, and compiling takes longer on a loaded
machine, so two runs of one script could stop at different candidates and train on different
plans: the same model, but rounded differently (a run killed and resumed would then not end like
an uninterrupted one). So where the clock stopped a search, or let it price every candidate, is
cached per machine (``$PARALLAX_CACHE_DIR``, with the first candidate's program): every later run
of the same search there tries exactly the candidates the first tried, and picks the same plan
(timing its close calls from the same cache). The first run stored wins, as for the other
measurements (:mod:`parallax._cache`).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from typing import Any

from parallax import _cache, _multihost
from parallax.pricing.timing import program_text

CACHE_FILE = "search_stops.json"
REPLAYED = " (as this search's first run on this machine stopped: cached)"


class SearchBudget:
    """Says before each candidate whether the search must stop, and after the search whether it did.

    Args:
        seconds: ``search_seconds`` (``None``: no bound of its own).
        steps: the run's length in steps, if known.
        devices_key: the machine and devices (:func:`parallax.pricing.cost.device_key`).
        labels: every candidate's label, in the order they are priced (they name the search).
    """

    def __init__(self, seconds: float | None, steps: int | None, devices_key: str, labels: Sequence[str]):
        self.seconds, self.steps = seconds, steps
        self._start = time.perf_counter()
        self._key = f"{devices_key}|{seconds}|{steps}|{'; '.join(labels)}"
        self._named = False  # the key holds the first candidate's program
        self._replay: dict | None = None  # the first run's stops, once the first candidate is priced
        self._stops: dict[str, str] = {}  # this run's, by the decision's number
        self._decisions = 0

    def priced(self, program: Any) -> None:
        """Notes a priced candidate's compiled program: the first one names the search in the cache."""
        if self._named:
            return
        self._named = True
        self._key += "|" + hashlib.sha256(program_text(program).encode()).hexdigest()
        found = _cache.read(CACHE_FILE).get(self._key)
        self._replay = found if isinstance(found, dict) else None

    def stop(self, estimates: dict) -> str | None:
        """Why the next candidate is not priced (``None``: price it), given the estimates so far; the
        first candidate is always priced. Process 0 decides for every process."""
        return self._decide(estimates)

    def stopped(self, estimates: dict) -> str | None:
        """Why the search ended early, after the last candidate (``None``: it may time its close
        calls); stores this run's stops (none, where it priced every candidate) for the next run."""
        reason = self._decide(estimates)
        if self._replay is None and self._named:
            _cache.store(CACHE_FILE, self._key, self._stops)  # a run that stopped first at once keeps its own
        return reason

    def _decide(self, estimates: dict) -> str | None:
        number = str(self._decisions)
        self._decisions += 1
        if not estimates:
            return None
        if self._replay is not None:
            reason = self._replay.get(number)
            return _multihost.agree(None if reason is None else reason + REPLAYED)
        reason = _multihost.agree(self._clock(estimates))
        if reason is not None:
            self._stops[number] = reason.removesuffix(REPLAYED)
        return reason

    def _clock(self, estimates: dict) -> str | None:
        elapsed = time.perf_counter() - self._start
        if self.seconds is not None and elapsed > self.seconds:
            return f"not tried: the search had spent its {self.seconds:g} s (search_seconds)"
        best = min(e.seconds for e in estimates.values())
        if self.steps and elapsed > self.steps * best:
            return (f"not tried: the search had spent {elapsed:.1f} s, more than {self.steps} steps of the best "
                    f"so far ({1e3 * best:.1f} ms each) take, and no plan saves more than a whole step")
        return None
