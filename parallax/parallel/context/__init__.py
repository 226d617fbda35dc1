"""Context parallelism: a sequence split over an axis, the model's own attention run over the split.

``part`` (``ContextParallel``: places no param, declares a ``ContextRun``), ``attention`` (the attentions a
traced loss computes, found and re-run split along the queries), ``weights`` (an
attention's ops from scores to weights, and its mask a tile at a time), ``tiles`` (those
ops on one tile of the scores, combined online), ``ring`` (keys passed round the axis) and ``balanced``
(zig-zag order, the tiles the mask hides skipped, and which those are).
"""
