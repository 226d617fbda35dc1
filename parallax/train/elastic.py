"""Resuming on another number of devices with the same training: the global batch is kept.

A checkpoint records how many data shards its run had and its gradient accumulation. A run
that resumes it with another mesh keeps the *global* batch (the same examples per update, in
the same order), in one of two ways:

- ``elastic="keep_batch"`` (default): each data shard takes more (or fewer) rows. Exact for
  any loss and model: BatchNorm statistics and, on the ``jit`` path, dropout masks are those
  of the global batch, whatever the device count.
- ``elastic="accumulate"``: each shard keeps its rows per microbatch (its memory) and the
  gradient accumulation makes up the difference (8 devices × 1 → 4 devices × 2). Exact for a
  loss that is a mean of per-example terms; BatchNorm then normalises each microbatch and
  dropout draws one mask per microbatch, so those differ from the uninterrupted run.

On the ``shard_map`` path each data shard draws dropout from its own key for its own rows
(the model's ``make_rng`` draws one mask for what it sees), so masks depend on the shard
count there whatever the scheme: such a run trains to the same loss within noise, not to the
same numbers.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("parallax")

MODES = ("keep_batch", "accumulate")


def layout_of(mesh_shape: Mapping[str, int], data_shards: int, grad_accum: int) -> dict[str, Any]:
    """What a checkpoint records of its run's layout."""
    return {"devices": int(math.prod(mesh_shape.values())), "data_shards": int(data_shards),
            "grad_accum": int(grad_accum)}


def adapt(metadata: Mapping, *, mode: str, batch_size: int, data_shards: int, grad_accum: int,
          mesh_shape: Mapping[str, int]) -> tuple[int, dict | None]:
    """The gradient accumulation to resume with, and the change to log and record (``None``: none).

    Args:
        metadata: the checkpoint's metadata (``layout`` as :func:`layout_of` wrote it).
        mode: ``"keep_batch"`` or ``"accumulate"``.
        batch_size: this run's global batch size.
        data_shards: this run's number of data shards.
        grad_accum: this run's configured gradient accumulation.
        mesh_shape: this run's mesh.

    Raises:
        ValueError: the global batch cannot be kept on this mesh; the message names the sizes
            and the options.

    Example:
        >>> saved = {"layout": {"devices": 8, "data_shards": 8, "grad_accum": 1}, "batch_size": 64}
        >>> adapt(saved, mode="accumulate", batch_size=64, data_shards=4, grad_accum=1, mesh_shape={"fsdp": 4})[0]
        2
    """
    saved = metadata.get("layout")
    devices = int(math.prod(mesh_shape.values()))
    if saved is None or (saved["data_shards"] == data_shards and saved["devices"] == devices):
        return grad_accum, None
    saved_batch = int(metadata.get("batch_size") or batch_size)
    saved_rows = saved_batch // (saved["data_shards"] * saved["grad_accum"])  # per shard and microbatch
    before = f"{saved['devices']} devices ({saved['data_shards']} data shards, grad_accum {saved['grad_accum']})"
    after = f"{devices} devices ({data_shards} data shards)"
    accum = grad_accum
    if mode == "accumulate":
        if saved_rows == 0 or batch_size % (data_shards * saved_rows):
            raise ValueError(
                f"elastic='accumulate': the checkpoint was written on {before} with {saved_rows} rows per data "
                f"shard and microbatch; the global batch {batch_size} is not a whole number of such microbatches "
                f"on {data_shards} data shards. Use elastic='keep_batch' (more rows per shard), a batch_size that "
                f"is a multiple of {data_shards * max(saved_rows, 1)}, or a device count whose data shards divide "
                f"{batch_size // max(saved_rows, 1)}.")
        accum = batch_size // (data_shards * saved_rows)
    elif batch_size % (data_shards * grad_accum):
        accumulating = (f" or with elastic='accumulate' (grad_accum {batch_size // (data_shards * saved_rows)})"
                        if saved_rows and batch_size % (data_shards * saved_rows) == 0 else "")
        raise ValueError(
            f"The checkpoint was written on {before}; this run has {after}, and its global batch {batch_size} "
            f"(grad_accum {grad_accum}) does not split over {data_shards} data shards. Keep the batch with a device "
            f"count whose data shards divide {batch_size // grad_accum}{accumulating}; or change the batch with "
            f"batch_size= a multiple of {data_shards * grad_accum} (training continues at the same example where "
            f"it can).")
    per_shard = batch_size // (data_shards * accum)
    change = {"from": dict(saved), "to": layout_of(mesh_shape, data_shards, accum), "global_batch": batch_size,
              "mode": mode}
    how = (f"grad_accum {accum} keeps {per_shard} rows per data shard and microbatch" if mode == "accumulate"
           else f"{per_shard} rows per data shard and microbatch")
    kept = (f"Global batch {batch_size} kept" if batch_size == saved_batch
            else f"Global batch {batch_size} (batch_size= changed it from {saved_batch})")
    log.warning("Resuming on %s; the checkpoint's run had %s. %s: %s.", after, before, kept, how)
    return accum, change
