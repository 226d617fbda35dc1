"""Pipeline parallelism: a stack of layers split over a stage axis.

``part`` (``PipelineParallel``: the stage axis, the stack's specs, the ``PipelineRun`` it declares),
``stacked_blocks`` (a list of blocks' params held stacked), ``stacking`` (whether a list is held stacked, the
optimizer checked), ``schedule`` (GPipe and circular over the microbatches), ``stack`` (the stacks a traced
loss runs, run as the pipeline), ``layer`` (a pipelined layer's body on its stage), ``rows`` (which
operands hold the examples, and the proof that each example's rows read only its own: what makes microbatches
exact).
"""
