"""Preemption: SIGTERM, or a first Ctrl-C, asks training to finish its step, save it and stop."""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

log = logging.getLogger("parallax")


class Preemption:
    """A context in which SIGTERM and a first SIGINT are recorded instead of ending the process.

    ``requested`` names the signal that asked to stop (``"SIGTERM"``, ``"SIGINT"``) or is
    ``None``. A second SIGINT stops at once (``KeyboardInterrupt``, nothing saved). Outside
    the main thread signals cannot be caught; the context then does nothing.

    Example:
        >>> with Preemption() as preemption:
        ...     preemption.requested is None
        True
    """

    def __init__(self):
        self.requested: str | None = None
        self._previous: Any = None

    def _handler(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.requested == "SIGINT":
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt("second SIGINT: stopped at once, without saving")
        if self.requested is None:
            self.requested = signal.Signals(signum).name
            if signum == signal.SIGINT:
                log.warning("SIGINT: finishing this step and saving it; press Ctrl-C again to stop at once.")

    def __enter__(self) -> "Preemption":
        self.requested = None
        if threading.current_thread() is threading.main_thread():
            self._previous = (signal.signal(signal.SIGTERM, self._handler), signal.signal(signal.SIGINT, self._handler))
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous[0])
            signal.signal(signal.SIGINT, self._previous[1])
            self._previous = None
