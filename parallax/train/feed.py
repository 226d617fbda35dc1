"""The batches of a run, placed on the devices ahead of the step that uses them.

A background thread reads the next ``depth`` batches from the source, lays each out as
global arrays (``to_global``: the host-to-device copy) and notes where the source stands after
it (``source.state()``, for iterators with ``get_state()``), while the current step runs. The
state saved with a checkpoint is the one after the batch of the step saved, not after the
batches read ahead, so a resume yields exactly the batches the uninterrupted run would.

With ``depth=0`` batches are read and placed in the training loop's own thread.
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.sharding import NamedSharding

from parallax import _multihost
from parallax.train.data import to_global

_END = object()


class Feed:
    """``next(feed)`` → ``(host batch, global batch)``; :attr:`state` is the source's position
    after the last batch handed out.

    Args:
        source: an ``ArrayData`` / ``MapData`` / ``IterableData``.
        position: the global batch to start at.
        saved: the source's saved state to start from instead (an iterator's), or ``None``.
        sharding: the batch's layout.
        depth: batches placed ahead (0: none, read in the caller's thread).
        check: ``check(batch, step)`` before a batch is placed (raises for one the step cannot take).
        first_step: the step the first batch is for.
        count: read at most this many batches (the steps left: nothing is read that is not trained on).
    """

    def __init__(self, source: Any, position: int, saved: dict | None, sharding: NamedSharding, depth: int,
                 check: Callable[[Any, int], None] = lambda batch, step: None, first_step: int = 1,
                 count: int | None = None):
        self.source, self.sharding, self.depth = source, sharding, depth
        self._check, self._step = check, first_step
        self.state: dict | None = source.state() if saved is None else saved
        self._batches: Iterator = source.iter_from(position, saved)
        self._left = count
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._thread = None
        if depth > 0:
            self._thread = threading.Thread(target=self._read_ahead, name="parallax-prefetch", daemon=True)
            self._thread.start()

    def _read(self) -> tuple | object:
        if self._left is not None:
            if self._left == 0:
                return _END
            self._left -= 1
        batch = next(self._batches, _END)
        if batch is _END:
            return _END
        self._check(batch, self._step)
        self._step += 1
        return batch, to_global(batch, self.sharding), self.source.state()

    def _read_ahead(self) -> None:
        try:
            while not self._stop.is_set():
                item = self._read()
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.05)
                        break
                    except queue.Full:
                        continue
                if item is _END:
                    return
        except BaseException as err:  # handed to the training loop, raised there
            self._queue.put(("error", err))
        finally:
            self._batches.close()

    def __iter__(self) -> Feed:
        return self

    def __next__(self) -> tuple[Any, Any]:
        item = self._read() if self._thread is None else self._queue.get()
        if item is _END:
            raise StopIteration
        if len(item) == 2:
            raise item[1]
        batch, placed, self.state = item
        return batch, placed

    def close(self) -> None:
        """Stops reading ahead and ends the source's iterators (a Grain loader's workers stop)."""
        self._stop.set()
        if self._thread is not None:
            while self._thread.is_alive():
                try:
                    self._queue.get(timeout=0.05)
                except queue.Empty:
                    pass
            self._thread.join()
        else:
            self._batches.close()
        self.source.close()


def data_record(feed: Feed | None) -> dict | None:
    """Every process's source state for the checkpoint record (a collective: every process calls
    it), or ``None`` where the source keeps none."""
    state = None if feed is None else feed.state
    states = [json.loads(text) for text in _multihost.gather_text(json.dumps(state))]
    return None if all(s is None for s in states) else {"processes": len(states), "states": states}


def saved_state(metadata: dict) -> dict | None:
    """This process's saved source state from a checkpoint's record, checked against the run.

    ``None`` where none was saved (the source resumes from the position, re-reading if it must).
    """
    record = metadata.get("data")
    if not record:
        return None
    processes, index = jax.process_count(), jax.process_index()
    if record["processes"] != processes:
        raise ValueError(
            f"The checkpoint saved the data iterator's position in each of {record['processes']} processes; this "
            f"run has {processes}. A Grain IterDataset's or DataLoader's state is per process: resume on "
            f"{record['processes']} processes, or train from a grain.MapDataset with batch_size= (parallax maps "
            "global positions, on any number of processes).")
    return record["states"][index]
