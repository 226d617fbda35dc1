"""Preemption: SIGTERM, or a first Ctrl-C, asks training to finish its step, save it and stop.

With several processes a signal may reach any subset of them, at any moment, and every
process must still stop after the same step (the checkpoint save is collective). JAX's
preemption service does that: after ``jax.distributed.initialize`` it owns SIGTERM, tells
every process when any one is signalled, and they agree on a step through the coordination
service; each process only checks a local flag per step (``reached_preemption_sync_point``).
A first Ctrl-C is passed on to it as a SIGTERM.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

import jax

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
        self._previous: dict = {}
        self._shared = False  # several processes, agreeing through JAX's preemption service
        self._agreed = False

    def _handler(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.requested == "SIGINT":
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt("second SIGINT: stopped at once, without saving")
        if self.requested is None:
            self.requested = signal.Signals(signum).name
            if signum == signal.SIGINT:
                log.warning("SIGINT: finishing this step and saving it; press Ctrl-C again to stop at once.")
            if self._shared:
                os.kill(os.getpid(), signal.SIGTERM)  # to JAX's preemption notifier, which tells every process

    def __enter__(self) -> Preemption:
        self.requested, self._agreed = None, False
        self._shared = jax.process_count() > 1 and _preemption_service() is not None
        if jax.process_count() > 1 and not self._shared:
            log.warning("JAX's preemption service is off (jax_enable_preemption_service=False): each process stops "
                        "on its own signal, and processes signalled at different steps wait for each other forever.")
        if threading.current_thread() is threading.main_thread():
            # With several processes SIGTERM is left to JAX's notifier (it installed its own handler).
            caught = (signal.SIGINT,) if self._shared else (signal.SIGTERM, signal.SIGINT)
            self._previous = {signum: signal.signal(signum, self._handler) for signum in caught}
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}

    def stop_after(self, step: int) -> bool:
        """Whether training stops after ``step``; call it once per step, on every process.

        In one process: whether a signal arrived. With several: whether ``step`` is the step
        every process agreed to stop at, once any of them was signalled.
        """
        if self._shared and not self._agreed:
            from jax.experimental import multihost_utils

            if multihost_utils.reached_preemption_sync_point(step):
                self._agreed = True
                self.requested = self.requested or "a signal to one of the processes"
        return self.stopping

    @property
    def stopping(self) -> bool:
        """Whether training stops at the step :meth:`stop_after` last saw (no agreement asked)."""
        return self._agreed if self._shared else self.requested is not None


    def report(self, saved_step: int | None, on_preemption: str) -> None:
        """Logs how a preempted ``fit`` ended; exits the process (status 0) for ``on_preemption="exit"``."""
        saved = f"saved step {saved_step}" if saved_step is not None else "no checkpoint_dir, nothing saved"
        log.warning("Preempted (%s): %s, %s.", self.requested, saved,
                    "exiting" if on_preemption == "exit" else "returning")
        if on_preemption == "exit":
            raise SystemExit(0)


def _preemption_service() -> Any:
    from jax._src import distributed as jax_distributed
    return getattr(jax_distributed.global_state, "preemption_sync_manager", None)
