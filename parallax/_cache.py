"""The per-machine cache of measurements (device speeds, timed candidates): JSON files in
``$PARALLAX_CACHE_DIR`` (``~/.cache/parallax`` by default), written atomically.

The first measurement stored under a key is the one every process on the machine uses: two
processes measuring at once (parallel test workers on a cold cache) would otherwise each
price with their own noisy figures, and the one that wrote last would change, halfway
through the other's run, what that process picks (a plan and the step it describes
disagreeing on a close call).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib
import tempfile
from collections.abc import Iterator
from typing import Any


def path_of(name: str) -> pathlib.Path:
    """The cache file ``name`` (e.g. ``"device_speeds.json"``)."""
    root = os.environ.get("PARALLAX_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "parallax")
    return pathlib.Path(root) / name


def read(name: str) -> dict:
    """Everything cached in ``name``: empty when there is no cache yet, or a crash left it half-written."""
    try:
        found = json.loads(path_of(name).read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def store(name: str, key: str, value: Any, *, replace: bool = False) -> Any:
    """Caches ``value`` (JSON) under ``key`` in ``name`` and returns what the cache now holds there.

    Unless ``replace``, a value another process stored first under ``key`` is kept and
    returned instead. A read-only home only means nothing is kept (``value`` is returned).
    """
    path = path_of(name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(path):
            cached = read(name)
            if not replace and key in cached:
                return cached[key]
            cached[key] = value
            with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
                json.dump(cached, f, indent=1)
            os.replace(f.name, path)  # atomic: parallel processes never read half a file
    except OSError:
        pass
    return value


@contextlib.contextmanager
def _locked(path: pathlib.Path) -> Iterator[None]:
    """Holds an exclusive lock on ``path``'s lock file: one process at a time reads, updates and writes."""
    with open(path.with_suffix(path.suffix + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
