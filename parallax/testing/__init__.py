"""Prove it on your own model: a sharded run checked against one device, step by step.

:func:`assert_equivalent` trains your model under a strategy and, from the same initial
state on the same batches, with a plain one-device optax loop that shares nothing with
parallax's step builders (no ``shard_map``, no collectives, no sharding), then compares the
loss of every step and the final params, optimizer state and model state. A failure is an
:class:`NotEquivalentError` whose message says where training went apart: the first step
whose loss differs, the params (by path) whose values and first-step gradients differ most,
and which part of the state differs (params, optimizer state, model state such as BatchNorm
statistics).

The reference follows the semantics the step declares (``step.mode()``): the loss on the
global batch (``jit``), or, for the ``shard_map`` path, the loss of each data shard with that
shard's dropout key and BatchNorm over all shards, averaged (run on one device with
``jax.vmap``). Step ``t`` draws from ``fold_in(state.rng, t)``, as the train state documents.

The tolerance (``tolerance="auto"``) is 1e-5 until a difference passes it; then twice the
drift of plain ``jit`` with the same values placed on the mesh, and for each param element
also twice what the optimizer amplifies of twice the gradients' rounding (:mod:`.rounding`).

:func:`fake_devices` gives a CPU process simulated devices for your own test suite.
"""

from parallax.testing.devices import fake_devices
from parallax.testing.equivalence import EquivalenceReport, NotEquivalentError, assert_equivalent
from parallax.testing.rounding import (
                                      LEVEL_MARGIN,
                                      ROUNDING_MARGIN,
                                      dither,
                                      excess,
                                      gradient_rounding,
                                      optimizer_rounding,
                                      rounding_allowance,
)

__all__ = [
                                      "LEVEL_MARGIN",
                                      "ROUNDING_MARGIN",
                                      "EquivalenceReport",
                                      "NotEquivalentError",
                                      "assert_equivalent",
                                      "dither",
                                      "excess",
                                      "fake_devices",
                                      "gradient_rounding",
                                      "optimizer_rounding",
                                      "rounding_allowance",
]
