"""Strategies by short name, as ``px.plan``, its command line and the Trainer take them:
``"dp"``, ``"fsdp"``, ``"tp"``, ``"pp"``, ``"cp"``, ``"ep"``, joined by ``+``, each with an optional size."""

from __future__ import annotations

import re

from parallax.parallel.context.part import ContextParallel
from parallax.parallel.experts.part import ExpertParallel
from parallax.parallel.pipeline.part import PipelineParallel
from parallax.sharding.parts import FSDP, DataParallel, TensorParallel
from parallax.sharding.strategy import Strategy, combine

_PARTS = {"dp": DataParallel, "fsdp": FSDP, "tp": TensorParallel, "pp": PipelineParallel, "cp": ContextParallel,
          "ep": ExpertParallel}
_TOKEN = re.compile(r"^(dp|fsdp|tp|pp|cp|ep)(\d*)$")


def parse_strategy(text: str | Strategy) -> Strategy:
    """A strategy from a short name: ``dp``, ``fsdp``, ``tp``, ``pp`` (pipeline stages), ``cp`` (context), ``ep``
    (experts), joined by ``+``, each with an optional size (``fsdp+tp2``: tensor axis of 2, FSDP over the devices left).

    Example:
        >>> parse_strategy("dp2+fsdp").describe()
        'DataParallel(data=2) × FSDP(fsdp=-1)'
        >>> parse_strategy("pp2+fsdp").describe()
        'PipelineParallel(stage=2) × FSDP(fsdp=-1)'
    """
    if isinstance(text, Strategy):
        return text
    parts = []
    for token in str(text).lower().split("+"):
        match = _TOKEN.match(token.strip())
        if match is None:
            raise ValueError(f"strategy {text!r}: {token!r} is not dp, fsdp, tp, pp, cp or ep with an optional size "
                             "(e.g. 'fsdp', 'dp2+fsdp', 'fsdp+tp2', 'pp2+fsdp', 'cp4+fsdp', 'ep4+fsdp'); pass one, "
                             "'auto', or a px strategy object.")
        parts.append(_PARTS[match.group(1)](int(match.group(2)) if match.group(2) else -1))
    return parts[0] if len(parts) == 1 else combine(*parts)
