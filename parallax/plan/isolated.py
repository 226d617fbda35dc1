"""Planning for more devices than this process has: a child process with N simulated CPU devices.

The parent sends the model, optimizer, batch, loss and strategies with ``cloudpickle`` (by
reference where they are importable, by value otherwise: a model class defined in a script
or a notebook works) or as ``module:attr`` strings the child imports; the child plans every
candidate on its devices and writes the rows back as JSON.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Any, Mapping

_DEVICE_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S+")


def run(payload: Mapping[str, Any], devices: int, timeout: float = 1800) -> list[dict]:
    """The plan rows of ``payload`` computed in a child with ``devices`` simulated CPU devices."""
    import cloudpickle

    try:
        data = cloudpickle.dumps(dict(payload))
    except Exception as err:  # noqa: BLE001 - name the argument that cannot travel
        bad = next((k for k, v in payload.items() if not _picklable(v)), "an argument")
        raise ValueError(f"Planning for {devices} devices runs in a subprocess, and {bad} cannot be sent to it "
                         f"({type(err).__name__}: {err}). Pass it as a 'package.module:name' string the subprocess "
                         "can import instead.") from None
    flags = _DEVICE_FLAG.sub("", os.environ.get("XLA_FLAGS", "")).strip()
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={devices}".strip(),
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p and os.path.isdir(p)))
    with tempfile.TemporaryDirectory(prefix="parallax-plan-") as folder:
        source, target = os.path.join(folder, "payload.pkl"), os.path.join(folder, "rows.json")
        with open(source, "wb") as f:
            f.write(data)
        proc = subprocess.run([sys.executable, "-m", "parallax.plan.isolated", source, target], env=env,
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"Planning on {devices} simulated CPU devices failed in its subprocess "
                               f"(exit status {proc.returncode}):\n{proc.stderr[-3000:]}")
        with open(target) as f:
            return json.load(f)


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

    with open(argv[0], "rb") as f:
        payload = pickle.load(f)
    args = {kind: resolve(kind, payload[kind]) for kind in ("model", "optimizer", "batch", "loss_fn")}
    rows = [evaluate(args["model"], args["optimizer"], args["batch"], args["loss_fn"], parse_strategy(strategy),
                     jax.devices(), payload["options"], payload["rng"], payload.get("topology"))
            for strategy in payload["strategies"]]
    with open(argv[1], "w") as f:
        json.dump(rows, f)


if __name__ == "__main__":
    main(sys.argv[1:])
