"""Planning the state: its layout on the mesh (:func:`plan_state`), what it holds per device
(:func:`parallax.state.summary.summarize`), pretrained params placed into it, the search that
picks a strategy or an FSDP split by compiling each candidate's step
(:mod:`parallax.state.search`), and the built state (:func:`init_state`).

Above building the step (:mod:`parallax.step`, whose steps it compiles to price a plan) and the
pricing (:mod:`parallax.pricing`); below the Trainer.
"""

from parallax.state.initialize import init_state
from parallax.state.plan import StatePlan, plan_state

__all__ = ["StatePlan", "init_state", "plan_state"]
