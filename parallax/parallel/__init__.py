"""The dimensions that change how a model runs, a folder each, and the space of candidates planning prices.

- :mod:`~parallax.parallel.pipeline`: ``PipelineParallel``: its part, the stacked blocks, the schedules
  (GPipe, circular), the traced stack run as a pipeline, the per-layer proof that each example's rows stay
  its own.
- :mod:`~parallax.parallel.context`: ``ContextParallel``: its part and the attentions found in a trace, run
  over the sequence split (gathered, a ring, load-balanced tiles with an online softmax).
- :mod:`~parallax.parallel.experts`: ``ExpertParallel``: its part, the stacked experts' matmuls and a list of
  experts, split by expert.
- :mod:`~parallax.parallel.candidates`: every mesh ``strategy="auto"`` and ``px.plan`` price, with what a
  model's trace adds; strategies by short name
  (:mod:`~parallax.parallel.names`); the mesh a strategy is laid out on (:mod:`~parallax.parallel.mesh_context`).

Data, FSDP and tensor parallelism place arrays only and live in :mod:`parallax.sharding`.
"""
