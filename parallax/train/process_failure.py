"""The other processes of a fit: every process ends when one fails, and data ends together.

A multi-process run blocks in collectives: a process that raises, is killed, or runs out of
data leaves the others waiting in the next step forever (JAX ends them only after its
heartbeat timeout, 100 s unless :func:`parallax.distributed.initialize` set it, and a process
that raised waits at JAX's shutdown barrier for processes that wait for it). During
``Trainer.fit`` every process therefore keeps in touch through JAX's coordination service
(small messages to process 0's key-value store, off the devices):

* a watch thread on every process counts up a heartbeat key each second and reads the
  others': a process whose heartbeat stops for ``silence`` seconds (killed, out of memory, its
  host gone) ends every other process, with a line naming it;
* a process whose fit raises writes its error there; the others print it and end within
  ``grace`` (3 s) unless their own fit ends too (an error every process raises alike, such as
  a check's, ends none; process 0, whose store the others read, ends last); the raising
  process itself exits after its traceback (an uncaught exception:
  :func:`parallax.distributed.initialize`'s ``fail_fast``, applied here to a run JAX was
  started for without it);
* data of unknown length (an iterator without ``len()``) may end on one process before
  another: before each step the processes meet at a barrier, each saying whether it has a
  batch, and all stop at the same step (a warning names the process whose data ended).

When process 0 itself dies, its store goes with it: JAX's client then ends every other process
at once with its own message (``Terminating process because the JAX distributed service
detected fatal errors``). In a single process nothing here runs.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import threading
import time
from typing import Any

import jax

log = logging.getLogger("parallax")

# this process's fits, in order: every process numbers its fits alike (they call fit together)
_FITS = itertools.count()
FAILED, ALIVE, ENDED, GONE, DONE = "failed", "alive", "ended", "gone", "done"


def _client() -> Any:
    """JAX's coordination-service client, or ``None`` (a single process, or JAX's API moved)."""
    if jax.process_count() == 1:
        return None
    try:
        from jax._src import distributed
        return distributed.global_state.client
    except (ImportError, AttributeError):
        return None


class Peers:
    """The other processes of one fit, watched from a thread; a context around the fit.

    Args:
        interval: seconds between heartbeats (and between reads of the others').
        silence: seconds without a heartbeat after which a process counts as dead.
        grace: seconds a process waits, once another's fit failed, for its own fit to end too
            (an error every process raises alike, a check's, ends no process); and at most
            what process 0, whose store the others read, waits for them to end before it does.

    Example:
        >>> with Peers() as peers:  # a single process: nothing to watch
        ...     peers.data_ended(False, step=1, length_known=False, max_steps=10)
        False
    """

    def __init__(self, interval: float = 1.0, silence: float = 10.0, grace: float = 3.0):
        self.interval, self.silence, self.grace = interval, silence, grace
        self.client = _client()
        self.index, self.count = jax.process_index(), jax.process_count()
        self.step = 0  # the step the loop is at, for the messages
        self._prefix = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reported = False

    def _key(self, kind: str, index: int | None = None) -> str:
        return f"{self._prefix}/{kind}/" + ("" if index is None else str(index))

    def _read(self, kind: str) -> dict[int, str]:
        return {int(key.rsplit("/", 1)[1]): value for key, value in self.client.key_value_dir_get(self._key(kind))}

    def __enter__(self) -> Peers:
        if self.client is None:
            return self
        self._prefix = f"parallax/fit{next(_FITS)}"
        _exit_at_once_on_uncaught_errors(self.index, self.silence)
        self._beat(0)
        self._thread = threading.Thread(target=self._watch, name="parallax-peers", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if self.client is None:
            return
        self.failed(error)
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if error is None or isinstance(error, KeyboardInterrupt):
            try:
                self.client.key_value_set(self._key(ALIVE, self.index), DONE, allow_overwrite=True)
            except Exception:  # the coordinator is gone: JAX ends this process itself
                pass

    def failed(self, error: BaseException | None) -> None:
        """Tells the others this process's fit raises ``error`` (once; before the fit's cleanup,
        which may itself wait for them). Those whose fit does not end within ``grace`` seconds
        end, naming it; an error every process raises alike (a check's) ends no process."""
        if self.client is None or error is None or isinstance(error, KeyboardInterrupt) or self._reported:
            return
        self._reported = True
        summary = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"[:400]
        try:
            self.client.key_value_set(self._key(FAILED, self.index), f"{self.step}|{summary}", allow_overwrite=True)
            if self.index == 0:  # the others read from process 0's store: it raises once they fail or end
                self._wait_for_others(2 * self.grace + self.interval)
        except Exception:  # the coordinator is gone: JAX ends this process itself
            return

    def _wait_for_others(self, seconds: float, silent: tuple[int, ...] = ()) -> None:
        """Waits until every other process (but the ``silent``) failed or ended, at most ``seconds``."""
        others = set(range(self.count)) - {self.index, *silent}
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not others <= set(self._read(FAILED)) | set(self._read(GONE)):
            time.sleep(0.1)

    def _beat(self, count: int) -> None:
        self.client.key_value_set(self._key(ALIVE, self.index), str(count), allow_overwrite=True)

    def _watch(self) -> None:
        """Beats, and ends this process when another failed (and this one's fit did not end too
        within ``grace``) or fell silent."""
        heard: dict[int, tuple[str, float]] = {}  # process -> (its last heartbeat, when it changed)
        failure_seen: float | None = None
        for count in itertools.count(1):
            if self._stop.wait(self.interval):
                return
            try:
                self._beat(count)
                failed = {index: value for index, value in self._read(FAILED).items() if index != self.index}
                alive = self._read(ALIVE)
            except Exception:  # the coordinator is gone: JAX's client ends this process itself
                return
            now = time.monotonic()
            if failed:
                failure_seen = now if failure_seen is None else failure_seen
                if now - failure_seen >= self.grace and not self._stop.is_set():
                    index, value = min(failed.items())
                    step, _, summary = value.partition("|")
                    self._end(f"process {index} of {self.count} failed at step {step} ({summary})")
            for index, value in alive.items():
                if index == self.index or value == DONE:
                    continue
                if heard.get(index, ("", 0.0))[0] != value:
                    heard[index] = (value, now)
                elif now - heard[index][1] > self.silence and not self._stop.is_set():
                    self._end(f"process {index} of {self.count} has sent no heartbeat for {self.silence:g} s "
                              "(killed, out of memory, or its host is gone)", silent=(index,))

    def _end(self, why: str, silent: tuple[int, ...] = ()) -> None:
        """Ends this process, which waits in a collective for one that will never join it."""
        sys.stderr.write(f"parallax: {why}; process {self.index} stops too, at step {self.step} (exit code 1).\n")
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        try:
            self.client.key_value_set(self._key(GONE, self.index), "1", allow_overwrite=True)
            if self.index == 0:  # the others read from process 0's store: it ends last
                self._wait_for_others(self.grace, silent)
        except Exception:
            pass
        logging.shutdown()
        os._exit(1)

    def data_ended(self, ended: bool, step: int, *, length_known: bool, max_steps: int) -> bool:
        """Whether the run stops here for want of data, decided alike on every process.

        Args:
            ended: whether this process's data ended (it has no batch for ``step``).
            step: the step the batch is for.
            length_known: whether the data has a length (every process checked before step one
                that it has as many batches as the others: nothing to agree on per step).
            max_steps: the run's last step, for the messages.

        Raises:
            ValueError: data with a length ended early on this process (its length was wrong).
        """
        self.step = step - 1
        if self.client is None:
            return ended
        if length_known:
            if ended:
                raise ValueError(
                    f"Process {self.index}: the training data ended after step {step - 1}, "
                    f"before max_steps={max_steps}, although its len() promised more. Give every process data whose "
                    "len() is the batches it yields.")
            return False
        if ended:
            self.client.key_value_set(self._key(ENDED, self.index), str(step))
        self.client.wait_at_barrier(f"{self._prefix}/batch{step}", 24 * 3600 * 1000)  # slow data is not an error
        ended_on = sorted(self._read(ENDED))
        if ended_on and len(ended_on) < self.count:
            log.warning("The training data of process%s %s ended after step %d while the other processes had more; "
                        "every process stops at step %d (stop_reason 'data exhausted'). Give every process as many "
                        "batches, or max_steps= at most the fewest.", "es" if len(ended_on) > 1 else "",
                        ", ".join(map(str, ended_on)), step - 1, step - 1)
        return bool(ended_on)


def _exit_at_once_on_uncaught_errors(index: int, silence: float) -> None:
    """``fail_fast`` for a run JAX was started for without :func:`parallax.distributed.initialize`,
    said once in a line."""
    from parallax import distributed

    if getattr(sys.excepthook, "parallax_fail_fast", False):
        return
    sys.excepthook = distributed._exit_at_once(sys.excepthook, distributed._processes(), None)
    if index == 0:
        log.warning("jax.distributed was started without px.distributed.initialize(): during fit the processes end "
                    "together when one fails or falls silent for %g s, and an uncaught error now exits its process "
                    "at once; JAX's own heartbeat timeout (100 s by default) applies outside fit. For the same "
                    "guarantees everywhere, call px.distributed.initialize() in place of jax.distributed.initialize().",
                    silence)
