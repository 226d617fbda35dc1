"""Shared set-up for the example scripts: simulated devices, strategies by name, data.

Import this module first: ``--devices N`` must reach XLA before JAX starts.
"""

from __future__ import annotations

import os
import sys


def simulate_devices(argv: list[str]) -> None:
    """With ``--devices N`` on the command line, simulate N CPU devices (set before JAX starts)."""
    count = None
    for index, arg in enumerate(argv):
        if arg.startswith("--devices="):
            count = arg.split("=", 1)[1]
        elif arg == "--devices" and index + 1 < len(argv):
            count = argv[index + 1]
    if count is not None:
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}"
        os.environ.setdefault("JAX_PLATFORMS", "cpu")


simulate_devices(sys.argv)
# The C++ runtime's INFO lines hidden (its warnings kept) unless TF_CPP_MIN_LOG_LEVEL asks for them.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
from absl import flags  # noqa: E402

import parallax as px  # noqa: E402

flags.DEFINE_string("strategy", None, "dp, fsdp, tp, a combination joined by '+' (dp+fsdp, fsdp+tp), or auto")
flags.DEFINE_integer("devices", None, "simulate this many CPU devices")


def quiet_logs() -> None:
    """Library log lines (absl's ``I…``/``W…`` of every Python logger at INFO) hidden unless
    ``--verbosity``/``-v`` asks for them: the progress line and the results stay readable.
    parallax's own warnings read as sentences (``parallax: ...``), not in absl's format."""
    import logging as std_logging

    from absl import logging

    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    handler = std_logging.StreamHandler()
    handler.setFormatter(std_logging.Formatter("parallax: %(message)s"))
    ours = std_logging.getLogger("parallax")
    ours.addHandler(handler)
    ours.propagate = False  # not again through absl's handler on the root logger


def strategy_from_name(name: str, tp_rules=None, min_weight_size: int = 2**10) -> px.Strategy | str:
    """``"dp+fsdp+tp"`` → ``combine(DataParallel(2), FSDP(2), TensorParallel(-1))``-like.

    The first axes get 2 devices each and the last takes the devices left over. ``"auto"``
    lets the Trainer pick the mesh by the cost model at the first batch.
    """
    if name == "auto":
        return "auto"
    makers = {
        "dp": lambda size: px.DataParallel(size),
        "fsdp": lambda size: px.FSDP(size, min_weight_size=min_weight_size),
        "tp": lambda size: px.TensorParallel(size, rules=tp_rules),
    }
    names = name.split("+")
    unknown = [n for n in names if n not in makers]
    if unknown or not names:
        raise ValueError(f"--strategy={name!r}: use dp, fsdp, tp, a '+' combination such as dp+fsdp, or auto.")
    parts = [makers[n](2 if i < len(names) - 1 else -1) for i, n in enumerate(names)]
    return parts[0] if len(parts) == 1 else px.combine(*parts)


def describe_run(strategy: px.Strategy | str) -> str:
    devices = jax.devices()
    if strategy == "auto":
        return f"strategy='auto' (picked at the first batch) on {len(devices)} {devices[0].platform.upper()} device(s)"
    return f"{strategy.describe(strategy.make_mesh(devices))} on {len(devices)} {devices[0].platform.upper()} device(s)"
