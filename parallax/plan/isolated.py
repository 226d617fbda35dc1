"""Planning for more devices than this process has: a child process with N simulated CPU devices,
or, for a TPU hardware, the abstract devices of a TPU slice the TPU compiler compiles for
(:mod:`parallax.plan.target`; the TPU compiler stays out of the caller's process).

The parent sends the model, optimizer, batch, loss and strategies with ``cloudpickle`` (by
reference where they are importable, by value otherwise: a model class defined in a script
or a notebook works) or as ``module:attr`` strings the child imports; the child plans every
candidate on its devices and writes the rows back as JSON. A child that dies is explained
(:func:`died`): the compiler's failed check, or the machine's memory, and what to try.
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
from typing import Any, Mapping

_DEVICE_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S+")
# XLA's CPU compiler (jaxlib 0.10 and 0.12) aborts in its all-reduce promotion pass on some pipelined bf16
# steps ("Invalid binary instruction opcode copy" in CloneAllReduce: the reduction of a bf16 psum the
# partitioner annotated, in a Llama under PipelineParallel × FSDP); the pass widens small all-reduces for the
# CPU's own runtime, which a plan never runs. The TPU compiler planned the same 405B step unaided.
CPU_PLANNING_FLAGS = "--xla_disable_hlo_passes=all-reduce-promotion"


def run(payload: Mapping[str, Any], devices: int, timeout: float = 1800) -> list[dict]:
    """The plan rows of ``payload`` computed in a child with ``devices`` simulated CPU devices."""
    import cloudpickle

    try:
        data = cloudpickle.dumps({**payload, "devices": devices})
    except Exception as err:  # noqa: BLE001 - name the argument that cannot travel
        bad = next((k for k, v in payload.items() if not _picklable(v)), "an argument")
        raise ValueError(f"Planning for {devices} devices runs in a subprocess, and {bad} cannot be sent to it "
                         f"({type(err).__name__}: {err}). Pass it as a 'package.module:name' string the subprocess "
                         "can import instead.") from None
    flags = _DEVICE_FLAG.sub("", os.environ.get("XLA_FLAGS", "")).strip()
    hardware = payload.get("hardware")
    simulated = 1 if hardware is not None and hardware.kind == "tpu" else devices  # a TPU's devices are the compiler's
    if simulated == devices and "--xla_disable_hlo_passes" not in flags:
        flags += f" {CPU_PLANNING_FLAGS}"
    with tempfile.TemporaryDirectory(prefix="parallax-plan-") as folder:
        source, target = os.path.join(folder, "payload.pkl"), os.path.join(folder, "rows.json")
        # What the compiler writes while a step compiles goes to this file (parallax.step.resharding): kept
        # here, it says why a compiler that aborted did.
        compiler = os.path.join(folder, "compiler-stderr")
        env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1", TPU_SKIP_MDS_QUERY="1",
                   XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={simulated}".strip(),
                   PYTHONPATH=os.pathsep.join(p for p in sys.path if p and os.path.isdir(p)),
                   PARALLAX_COMPILER_STDERR=compiler)
        with open(source, "wb") as f:
            f.write(data)
        where = (f"a {hardware.name} slice of {devices} chips (the TPU compiler)" if simulated != devices
                 else f"{devices} simulated CPU devices")
        try:
            proc = subprocess.run([sys.executable, "-m", "parallax.plan.isolated", source, target], env=env,
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"Planning on {where} took over {timeout:.0f} s in its subprocess and was stopped. Plan "
                               "fewer strategies or device counts per call.") from None
        if proc.returncode != 0:
            said = pathlib.Path(compiler).read_text(errors="replace") if os.path.exists(compiler) else ""
            raise RuntimeError(died(proc.returncode, proc.stderr + "\n" + said, where))
        with open(target) as f:
            return json.load(f)


def died(status: int, stderr: str, where: str) -> str:
    """Why a planning subprocess ended with ``status``, from its stderr, and what to try."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    checks = [line for line in lines if "Check failed" in line or re.match(r"^F\d{4} ", line)]
    if "MemoryError" in stderr or "RESOURCE_EXHAUSTED" in stderr or status == -signal.SIGKILL:
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


def _picklable(value: Any) -> bool:
    import cloudpickle

    try:
        cloudpickle.dumps(value)
        return True
    except Exception:  # noqa: BLE001
        return False


def main(argv: list[str]) -> None:
    """The child: plan every candidate of the payload on this process's devices."""
    import pickle

    import jax

    from parallax.plan.candidates import evaluate
    from parallax.sharding.named import parse_strategy
    from parallax.plan.refs import resolve
    from parallax.plan.target import tpu_devices

    with open(argv[0], "rb") as f:
        payload = pickle.load(f)
    args = {kind: resolve(kind, payload[kind]) for kind in ("model", "optimizer", "batch", "loss_fn")}
    hardware = payload.get("hardware")
    devices = (tpu_devices(hardware, payload["devices"]) if hardware is not None and hardware.kind == "tpu"
               else jax.devices())
    rows = [evaluate(args["model"], args["optimizer"], args["batch"], args["loss_fn"], parse_strategy(strategy),
                     devices, payload["options"], payload["rng"], payload.get("topology"), hardware,
                     payload.get("state_budget"))
            for strategy in payload["strategies"]]
    with open(argv[1], "w") as f:
        json.dump(rows, f)


if __name__ == "__main__":
    main(sys.argv[1:])
