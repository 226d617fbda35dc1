"""Pricing plans: what a compiled program costs, which of several is cheapest, and the timing that
settles close calls.

The cost model (:mod:`parallax.pricing.cost`) reads a compiled program's FLOPs, bytes and
collectives and prices them with this machine's measured speeds; :mod:`parallax.pricing.choice`
ranks priced candidates against a memory budget; :mod:`parallax.pricing.timing` runs the closest
few; :mod:`parallax.jaxpr.per_example` proves from a loss's trace which compile paths are
exact for it. The lowest of the three rooms of planning and stepping: it knows compiled programs
and traces, not steps or states, so a step (:mod:`parallax.step`) uses it to pick its compile
path and the search (:mod:`parallax.state.search`) to pick a plan.
"""
