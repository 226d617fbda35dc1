"""Reading and rewriting traced computations (jaxprs): the machinery the dimensions and the planner share.

A loss traced from shapes shows what a model does without running it: the chains of calls of one block
(:mod:`~parallax.jaxpr.chains`), identical modules called side by side (:mod:`~parallax.jaxpr.siblings`), the
dims a scan steps over and the tensor-parallel layout (:mod:`~parallax.jaxpr.computation`,
:mod:`~parallax.jaxpr.tp_layout`), where a value's batch rows and experts dims go
(:mod:`~parallax.jaxpr.follow_dims`), and whether a loss is a mean of per-example terms
(:mod:`~parallax.jaxpr.per_example`). :mod:`~parallax.jaxpr.rebind` binds an equation again, what every run
change that re-runs a trace shares. Nothing here knows a model library or a strategy.
"""
