"""The per-machine cache of measurements (device speeds, timed candidates): JSON files in
``$PARALLAX_CACHE_DIR`` (``~/.cache/parallax`` by default), written atomically."""

from __future__ import annotations

import json
import os
import pathlib
import tempfile
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


def store(name: str, key: str, value: Any) -> None:
    """Caches ``value`` (JSON) under ``key`` in ``name``; a read-only home only means it is not kept."""
    path = path_of(name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        cached = read(name)
        cached[key] = value
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(cached, f, indent=1)
        os.replace(f.name, path)  # atomic: parallel processes never read half a file
    except OSError:
        pass
