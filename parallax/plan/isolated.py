"""Planning for more devices than this process has: a child process with N simulated CPU devices,
or, for a TPU hardware, the abstract devices of a TPU slice the TPU compiler compiles for
(:mod:`parallax.plan.target`; the TPU compiler stays out of the caller's process).

The parent sends the model, optimizer, batch, loss and strategies with ``cloudpickle`` (by
reference where they are importable, by value otherwise: a model class defined in a script
or a notebook works) or as ``module:attr`` strings the child imports; the child plans every
candidate on its devices and writes the rows back as JSON. A child that dies is explained
(:func:`died`): the compiler's failed check, or the machine's memory, and what to try.

Priced on a named hardware (nothing timed on this machine: its speeds are the data sheet's), the
candidates are shared round-robin among up to :func:`workers` children compiling side by side, and
their rows merged in the candidates' order: the same rows, sooner on a machine with cores to spare.
Should one of them run out of memory, the candidates are planned again in one child.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from typing import Any

from parallax.plan.target import deviceless

_DEVICE_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S+")
# XLA's CPU compiler (jaxlib 0.10 and 0.12) aborts in its all-reduce promotion pass on some pipelined bf16
# steps ("Invalid binary instruction opcode copy" in CloneAllReduce: the reduction of a bf16 psum the
# partitioner annotated, in a Llama under PipelineParallel × FSDP); the pass widens small all-reduces for the
# CPU's own runtime, which a plan never runs. The TPU compiler planned the same 405B step unaided.
CPU_PLANNING_FLAGS = "--xla_disable_hlo_passes=all-reduce-promotion"


def workers(payload: Mapping[str, Any]) -> int:
    """How many children plan ``payload``'s candidates side by side: one per core (at most 4, at most one
    per candidate) where a named hardware prices them, else one (the cost model's speeds are measured on
    this machine, and children side by side would slow each other's timings)."""
    if payload.get("hardware") is None:
        return 1
    return max(1, min(len(payload["strategies"]), side_by_side()))


def side_by_side() -> int:
    """How many children at most plan side by side: one per core this process may use, at most 4."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, 4))


def run(payload: Mapping[str, Any], devices: int, timeout: float = 1800) -> list[dict]:
    """The plan rows of ``payload`` computed in children with ``devices`` simulated CPU devices (or the
    TPU compiler's slice), :func:`workers` of them side by side."""
    count = workers(payload)
    if count == 1:
        return _run([payload], devices, timeout)[0]
    strategies = list(payload["strategies"])
    shares = [{**payload, "strategies": strategies[i::count]} for i in range(count)]
    try:
        done = _run(shares, devices, timeout)
    except _OutOfMemory:  # side by side they did not fit this machine: one child, as without workers
        return _run([payload], devices, timeout)[0]
    rows: list[dict] = [{} for _ in strategies]
    for i, share in enumerate(done):
        rows[i::count] = share
    return rows


class _OutOfMemory(RuntimeError):
    """A planning child ran out of this machine's memory (its message is :func:`died`'s)."""


def _run(payloads: list[Mapping[str, Any]], devices: int, timeout: float) -> list[list[dict]]:
    """Each payload's rows, each planned in a child of its own, the children side by side."""
    import cloudpickle

    first = payloads[0]
    hardware = first.get("hardware")
    on_target = deviceless(hardware)  # its devices are the target compiler's, not simulated CPU devices
    try:
        data = [cloudpickle.dumps({**payload, "devices": devices, "deviceless": on_target}) for payload in payloads]
    except Exception as err:
        bad = next((k for k, v in first.items() if not _picklable(v)), "an argument")
        raise ValueError(f"Planning for {devices} devices runs in a subprocess, and {bad} cannot be sent to it "
                         f"({type(err).__name__}: {err}). Pass it as a 'package.module:name' string the subprocess "
                         "can import instead.") from None
    flags = _DEVICE_FLAG.sub("", os.environ.get("XLA_FLAGS", "")).strip()
    simulated = 1 if on_target else devices
    if not on_target and "--xla_disable_hlo_passes" not in flags:
        flags += f" {CPU_PLANNING_FLAGS}"
    where = (f"{devices} simulated CPU devices" if not on_target else
             f"a {hardware.name} slice of {devices} chips (the TPU compiler)" if hardware.kind == "tpu" else
             f"{devices} {hardware.name} GPUs (XLA's GPU compiler, without the GPUs)")
    with tempfile.TemporaryDirectory(prefix="parallax-plan-") as folder:
        children = []
        for i, sent in enumerate(data):
            source, target = os.path.join(folder, f"payload-{i}.pkl"), os.path.join(folder, f"rows-{i}.json")
            # What the compiler writes while a step compiles goes to this file (parallax.step.resharding): kept
            # here, it says why a compiler that aborted did.
            compiler = os.path.join(folder, f"compiler-stderr-{i}")
            env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1", TPU_SKIP_MDS_QUERY="1",
                       XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={simulated}".strip(),
                       PYTHONPATH=os.pathsep.join(p for p in sys.path if p and os.path.isdir(p)),
                       PARALLAX_COMPILER_STDERR=compiler)
            with open(source, "wb") as f:
                f.write(sent)
            stderr = open(os.path.join(folder, f"stderr-{i}"), "w+")  # noqa: SIM115 (read once the child ends)
            proc = subprocess.Popen([sys.executable, "-m", "parallax.plan.isolated", source, target], env=env,
                                    stdout=subprocess.DEVNULL, stderr=stderr)
            children.append((proc, stderr, target, compiler))
        deadline = time.monotonic() + timeout
        try:
            return [_rows(proc, stderr, target, compiler, where, timeout, deadline)
                    for proc, stderr, target, compiler in children]
        finally:
            for proc, stderr, _, _ in children:  # one failed or timed out: the others stop with it
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                stderr.close()


def _rows(proc: subprocess.Popen, stderr: Any, target: str, compiler: str, where: str, timeout: float,
          deadline: float) -> list[dict]:
    """A child's rows once it ends (by ``deadline``: the children's ``timeout``, together), or why it did
    not plan them."""
    try:
        status = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"Planning on {where} took over {timeout:.0f} s in its subprocess and was stopped. Plan "
                           "fewer strategies or device counts per call.") from None
    if status != 0:
        stderr.seek(0)
        compiled = pathlib.Path(compiler).read_text(errors="replace") if os.path.exists(compiler) else ""
        said = stderr.read() + "\n" + compiled
        raise (_OutOfMemory if _out_of_memory(status, said) else RuntimeError)(died(status, said, where))
    with open(target) as f:
        return json.load(f)


def died(status: int, stderr: str, where: str) -> str:
    """Why a planning subprocess ended with ``status``, from its stderr, and what to try."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    checks = [line for line in lines if "Check failed" in line or re.match(r"^F\d{4} ", line)]
    if _out_of_memory(status, stderr):
        why = ("it ran out of this machine's memory" + (" (killed by the system)" if status == -signal.SIGKILL else "")
               + f": compiling for {where} holds the whole program per device")
        fix = ("Plan fewer devices at once (one device count per call), a stacked (nn.scan) model instead of a list of "
               "blocks, or a TPU target (hardware='v5p'), whose compiler is lighter here")
    elif status < 0:
        name = signal.Signals(-status).name if -status in signal.Signals._value2member_map_ else f"signal {-status}"
        why = f"the compiler aborted ({name})" + (f": {checks[-1].strip()}" if checks else "")
        fix = ("This is XLA's own check failing, not your model: try another device count or strategy, or report it "
               "with the line above")
    else:
        last = next((line for line in reversed(lines) if re.match(r"^\w*(Error|Exception)\b", line)), None)
        why = f"exit status {status}" + (f": {last.strip()}" if last else "")
        fix = "The lines below are the subprocess's own"
    tail = "\n".join(lines[-20:])
    return f"Planning on {where} failed in its subprocess: {why}. {fix}.\n--- its last lines:\n{tail}"


def _out_of_memory(status: int, stderr: str) -> bool:
    """Whether a planning child ended for want of this machine's memory (killed by the system, or said so)."""
    return "MemoryError" in stderr or "RESOURCE_EXHAUSTED" in stderr or status == -signal.SIGKILL


def _picklable(value: Any) -> bool:
    import cloudpickle

    try:
        cloudpickle.dumps(value)
        return True
    except Exception:
        return False


def main(argv: list[str]) -> None:
    """The child: plan every candidate of the payload on this process's devices."""
    import pickle

    import jax

    from parallax.parallel.names import parse_strategy
    from parallax.plan.candidates import evaluate
    from parallax.plan.refs import resolve
    from parallax.plan.target import gpu_devices, tpu_devices

    with open(argv[0], "rb") as f:
        payload = pickle.load(f)
    args = {kind: resolve(kind, payload[kind]) for kind in ("model", "optimizer", "batch", "loss_fn")}
    hardware = payload.get("hardware")
    devices = (jax.devices() if not payload.get("deviceless") else  # as the parent decided
               tpu_devices(hardware, payload["devices"]) if hardware.kind == "tpu" else
               gpu_devices(hardware, payload["devices"]))
    rows = [evaluate(args["model"], args["optimizer"], args["batch"], args["loss_fn"], parse_strategy(strategy),
                     devices, payload["options"], payload["rng"], payload.get("topology"), hardware,
                     payload.get("state_budget"), payload.get("bound_only", False))
            for strategy in payload["strategies"]]
    with open(argv[1], "w") as f:
        json.dump(rows, f)


if __name__ == "__main__":
    main(sys.argv[1:])
