"""Start a multi-process run on this machine: ``python -m parallax.launch``, for development and CI.

Usage::

    python -m parallax.launch --processes 2 --devices-per-process 4 train.py ARGS...
    python -m parallax.launch --processes 2 -m my_package.train ARGS...

Each process runs the script with ``PARALLAX_COORDINATOR`` (127.0.0.1 and a free port),
``PARALLAX_NUM_PROCESSES`` and ``PARALLAX_PROCESS_ID`` set, which
:func:`parallax.distributed.initialize` reads; ``--devices-per-process`` gives each one that
many simulated CPU devices. Every output line is prefixed with its process index
(``[1] ...``). SIGINT and SIGTERM are forwarded to every process (a second SIGINT kills
them). The run fails as a whole: when any process exits non-zero, the others are killed (after
up to ``FAILURE_GRACE`` seconds in which any that also fail are named too: a process whose peer
failed may notice and exit first) and the launcher exits with the first one's code, naming it. ``--timeout`` kills
everything after that many seconds (exit 124). No process outlives the launcher.

On a cluster, start one process per host with the scheduler instead (``srun``, a
Kubernetes Job): :func:`parallax.distributed.initialize` finds its peers from there.
"""

from __future__ import annotations

import argparse
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

# Gloo's "[Gloo] Rank 0 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3",
# written piece by piece, so that a line may hold part of it (or another process line part of one).
_GLOO_CONNECTED = re.compile(rb"\[Gloo\] Rank \d* ?(is connected to ?)?\d* ?(peer ranks\. )?"
                             rb"(Expected number of connected peer ranks is : \d+)?"
                             rb"|\d* ?peer ranks\. Expected number of connected peer ranks is : \d+")
# JAX's preemption notifier reports the SIGTERM each process sends itself on a first Ctrl-C (that is
# how a SIGINT reaches every process through JAX's preemption service): hidden once the launcher
# forwarded a SIGINT, since each process already says "SIGINT: finishing this step and saving it".
_SIGTERM_CAUGHT = re.compile(rb"preemption_notifier\.cc:\d+\] SIGTERM caught")
FAILURE_GRACE = 3.0  # seconds after a first failure in which other failing processes are named too


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _environment(index: int, count: int, port: int, devices: int | None) -> dict[str, str]:
    env = dict(os.environ, PARALLAX_COORDINATOR=f"127.0.0.1:{port}", PARALLAX_NUM_PROCESSES=str(count),
               PARALLAX_PROCESS_ID=str(index), PYTHONUNBUFFERED="1")
    # The C++ runtime's INFO lines (Gloo's connections, XLA's notes) hidden, its warnings kept, unless asked for.
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    if devices is not None:
        flags = [flag for flag in env.get("XLA_FLAGS", "").split()
                 if not flag.startswith("--xla_force_host_platform_device_count")]
        env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
        env["JAX_PLATFORMS"] = "cpu"
    return env


def _describe(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


class Launch:
    """The processes of one launch, their output, and their end.

    Args:
        command: the command each process runs (``[python, script, args...]``).
        processes: how many processes.
        devices_per_process: simulated CPU devices per process (``None``: the real ones).
        port: the coordinator's port on 127.0.0.1 (a free one by default).
        out: where the prefixed output lines go.
    """

    def __init__(self, command: Sequence[str], processes: int, devices_per_process: int | None = None,
                 port: int | None = None, out=None):
        self.command = list(command)
        self.count = processes
        self.devices = devices_per_process
        self.port = port or _free_port()
        self.out = out or sys.stdout
        self.children: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._readers: list[threading.Thread] = []
        self._interrupts, self._terminated = 0, False
        self._exits: queue.Queue = queue.Queue()  # (index, code) in the order the processes end

    def say(self, line: str) -> None:
        with self._lock:
            self.out.write(line if line.endswith("\n") else line + "\n")
            self.out.flush()

    def _read(self, index: int, stream) -> None:
        quiet = os.environ.get("TF_CPP_MIN_LOG_LEVEL", "1") != "0"  # as the runtime's INFO lines: unless asked for
        for line in iter(stream.readline, b""):
            if quiet:  # Gloo prints each connection itself (not through the runtime's log), at times mid-line
                line = _GLOO_CONNECTED.sub(b"", line)
                if not line.strip() or (self._interrupts and not self._terminated and _SIGTERM_CAUGHT.search(line)):
                    continue
            self.say(f"[{index}] " + line.decode(errors="replace"))

    def start(self) -> None:
        for index in range(self.count):
            child = subprocess.Popen(self.command, env=_environment(index, self.count, self.port, self.devices),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
            self.children.append(child)
            reader = threading.Thread(target=self._read, args=(index, child.stdout), daemon=True)
            reader.start()
            self._readers.append(reader)
            threading.Thread(target=lambda i=index, c=child: self._exits.put((i, c.wait())), daemon=True).start()

    def forward(self, signum: int, frame=None) -> None:
        """Passes SIGINT/SIGTERM on to every process; a second SIGINT kills them."""
        self._terminated = self._terminated or signum == signal.SIGTERM
        if signum == signal.SIGINT:
            self._interrupts += 1
            if self._interrupts > 1:
                self.say("[launch] second SIGINT: killing every process")
                self.kill()
                return
        for child in self.children:
            if child.poll() is None:
                os.kill(child.pid, signum)

    def kill(self) -> None:
        """SIGKILL to every process still running, and to whatever each started (its session)."""
        for child in self.children:
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass  # the whole group has exited
        for child in self.children:
            child.wait()

    def wait(self, timeout: float | None = None) -> int:
        """Waits for the processes; the exit code of the launch (0 when all exited 0)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        finished = 0
        try:
            while finished < self.count:
                left = None if deadline is None else deadline - time.monotonic()
                try:
                    index, code = self._exits.get(timeout=None if left is None else max(left, 0))
                except queue.Empty:
                    self.say(f"[launch] timed out after {timeout:g}s; killing every process")
                    return 124
                finished += 1
                if code != 0:  # the first to fail; the others' errors usually follow from it
                    failed = [(index, code)] + self._failing_soon(self.count - finished)
                    for number, (which, how) in enumerate(failed, 1):  # whichever exits first names none alone
                        self.say(f"[launch] process {which} {_describe(how)}"
                                 + ("; ending the other processes" if number == len(failed) else ""))
                    return 128 - code if code < 0 else code
            return 0
        finally:
            self.kill()
            for reader in self._readers:
                reader.join(timeout=5)


    def _failing_soon(self, running: int, grace: float = FAILURE_GRACE) -> list[tuple[int, int]]:
        """The processes of ``running`` that exit with an error within ``grace`` seconds of a first
        failure: a process whose peer failed may notice and exit before the one that failed does."""
        failed, end = [], time.monotonic() + grace
        while running:
            try:
                index, code = self._exits.get(timeout=max(end - time.monotonic(), 0))
            except queue.Empty:
                break
            running -= 1
            if code != 0:
                failed.append((index, code))
        return failed


def _split(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """The launcher's own options, and the command after them (``script ARGS`` or ``-m module ARGS``)."""
    argv, index = list(argv), 0
    while index < len(argv):
        arg = argv[index]
        if arg == "-m" or not arg.startswith("-"):
            return argv[:index], argv[index:]
        index += 1 if "=" in arg or arg in ("-h", "--help") else 2
    return argv, []


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parallax.launch", description=__doc__.splitlines()[0],
                                     usage="%(prog)s [options] (script.py | -m module) [args...]")
    parser.add_argument("--processes", type=int, default=2, help="how many processes (default 2)")
    parser.add_argument("--devices-per-process", type=int, default=None,
                        help="simulated CPU devices per process (default: the machine's own devices)")
    parser.add_argument("--port", type=int, default=None, help="the coordinator's port (default: a free one)")
    parser.add_argument("--timeout", type=float, default=None, help="kill every process after this many seconds")
    own, rest = _split(sys.argv[1:] if argv is None else argv)
    options = parser.parse_args(own)
    if options.processes < 1:
        parser.error(f"--processes={options.processes}; pass at least 1.")
    if options.devices_per_process is not None and options.devices_per_process < 1:
        parser.error(f"--devices-per-process={options.devices_per_process}; pass at least 1.")
    if not rest or rest == ["-m"]:
        parser.error("name the script to run (or -m module).")
    command = [sys.executable, *rest]
    launch = Launch(command, options.processes, options.devices_per_process, options.port)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, launch.forward)
    launch.start()
    return launch.wait(options.timeout)


if __name__ == "__main__":
    sys.exit(main())
