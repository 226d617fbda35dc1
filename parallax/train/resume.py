"""Where a resumed run continues in its data: the same example, even with another batch size."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

log = logging.getLogger("parallax")


def data_position(metadata: Mapping, batch_size: int, steps_per_epoch: int | None, shards: int) -> int:
    """The batch to resume at: the same example as when the checkpoint was written.

    A checkpoint records its position in batches and the batch size. With another batch
    size, training continues at the same example of the same epoch when the new size
    divides the examples already seen in it; otherwise it is an error with the options.

    Example:
        >>> data_position({"position": 6, "batch_size": 32, "steps_per_epoch": 4}, 64, 2, 8)
        3
    """
    position = int(metadata["position"])
    saved_size = metadata.get("batch_size")
    if saved_size is None or int(saved_size) == batch_size:
        return position
    saved_size, new_size = int(saved_size), batch_size
    saved_epoch_steps = metadata.get("steps_per_epoch")
    epoch, offset = divmod(position, saved_epoch_steps) if saved_epoch_steps else (0, position)
    seen = offset * saved_size  # examples of this epoch already trained on
    if seen % new_size:
        small = [d for d in range(1, math.isqrt(seen) + 1) if seen % d == 0]
        divisors = [d for d in set(small + [seen // d for d in small]) if d % shards == 0]
        nearby = sorted(divisors, key=lambda d: (abs(d - new_size), d))[:3]
        raise ValueError(
            f"The checkpoint was written with batch_size={saved_size} after {seen} examples of epoch "
            f"{epoch}; batch_size={new_size} does not divide {seen}, so training cannot continue at the "
            f"same example. Resume with batch_size={saved_size}, or one that divides {seen} "
            f"(e.g. {', '.join(map(str, nearby))}), or start a new run in another checkpoint_dir."
        )
    if epoch and not steps_per_epoch:
        raise ValueError(
            f"The checkpoint was written with batch_size={saved_size} in epoch {epoch}; with batch_size="
            f"{new_size} the epoch length of this data is unknown, so the position cannot be carried "
            f"over. Resume with batch_size={saved_size}."
        )
    new_position = epoch * (steps_per_epoch or 0) + seen // new_size
    log.warning("Resuming with batch_size=%d instead of %d: continuing at example %d of epoch %d (batch %d).",
                new_size, saved_size, seen, epoch, new_position)
    return new_position
