"""Expert parallelism: a mixture of experts split by expert over an axis.

``part`` (``ExpertParallel``: places the stacked experts' dim, declares an ``ExpertRun``), ``dispatch`` (the
matmuls over stacked expert weights, split along the experts dim, tokens moved by all-to-all) and ``listed``
(a list of expert modules run as one batch split by expert, their params stacked in the step).
"""
