"""Compiling a step's paths ahead of time and pricing them: the part of
:class:`parallax.step.build.Step` that the cost model and the search call (nothing runs)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from parallax._compat import mesh_context
from parallax._errors import first_line
from parallax.parallel.pipeline.part import NoStackError
from parallax.pricing.choice import Choice, choose, memory_budget
from parallax.step.batch import layout_key, state_specs_of
from parallax.step.resharding import compile_reporting
from parallax.step.run_changes import pipelined_blocks
from parallax.step.train_state import TrainState

log = logging.getLogger("parallax")


class CompiledPaths:
    """What a :class:`~parallax.step.build.Step` compiles ahead of time, per state layout and
    path (``_compiled``), and how it prices and shares those programs."""

    def choose(self, state: TrainState, batch: Any) -> Choice:
        """Compiles every path of :meth:`modes` for this state and batch (real or abstract
        arrays; nothing runs) and prices each with the cost model."""
        return self.compile_paths(state, batch)[0]

    def compile_paths(self, state: TrainState, batch: Any) -> tuple[Choice, dict[str, Any], dict[str, Any]]:
        """Reads the loss's proof (:meth:`prove`), then compiles every path of :meth:`modes`
        ahead of time and prices each (nothing runs).

        Returns:
            The cost model's :class:`~parallax.pricing.choice.Choice`; per path that compiled,
            its jitted step (a call with arrays laid out like ``state`` and ``batch`` reuses
            the program) and its ``jax.stages.Compiled`` program.
        """
        mesh, specs = state_specs_of(state)
        self._check_mode(mesh)
        with mesh_context(mesh):
            self.prove(state, batch)
            parts = self._placed(state)[1]
            layout = layout_key(state, parts)
            functions, compiled, failed, params_layout = {}, {}, None, (state.params, specs.params, mesh)
            for mode in self.modes():
                if (layout, mode) in self._compiled:  # compiled before for this layout
                    functions[mode], compiled[mode] = self._compiled[layout, mode]
                    continue
                fn = self._function(mode, mesh, specs, parts)
                try:
                    compiled[mode], self.reshardings[mode] = compile_reporting(fn.lower(state, batch), *params_layout)
                except (ValueError, TypeError, NotImplementedError) as err:  # a path may not support this model
                    log.info("Compile path %s does not apply here (%s); not a candidate.", mode,
                             first_line(err))
                    failed = failed or err
                    continue
                functions[mode] = fn
                self._compiled[layout, mode] = fn, compiled[mode]
        if not compiled:
            raise failed
        devices = list(mesh.devices.flat)
        choice = choose(compiled, devices, memory_budget(self.options.memory_budget, devices), topology=self.topology,
                        speeds=self.speeds)
        return choice, {mode: functions[mode] for mode in compiled}, compiled

    def jaxprs(self, state: TrainState, batch: Any) -> dict[str, Any]:
        """The step's jaxpr on each path of :meth:`modes`, traced without compiling (a plan bounds a
        candidate's cost by them before it compiles anything); a path that does not apply is left out.

        Raises:
            ValueError, TypeError: no path applies (the first path's error).
        """
        mesh, specs = state_specs_of(state)
        self._check_mode(mesh)
        found, failed = {}, None
        with mesh_context(mesh):
            self.prove(state, batch)
            parts = self._placed(state)[1]
            for mode in self.modes():
                try:
                    found[mode] = self._function(mode, mesh, specs, parts).trace(state, batch).jaxpr.jaxpr
                except NoStackError as err:  # a pipeline that names no blocks= over a model with no stack
                    self.strategy = pipelined_blocks(self.strategy, state.model, batch, self.loss_fn, err)
                    return self.jaxprs(state, batch)
                except (ValueError, TypeError, NotImplementedError) as err:  # as compile_paths: not a candidate
                    failed = failed or err
        if not found:
            raise failed
        return found

    def reuse(self, priced: CompiledPaths | None) -> bool:
        """Takes over the programs ``priced`` compiled where it is this step (the same loss, strategy,
        kind and options, the compile path aside: the search prices its pick under ``compile="auto"``,
        the step that trains it names the path), so a state laid out alike runs them uncompiled
        again; returns whether it took any (not where they differ, or ``priced`` is ``None``)."""
        same = (priced is not None and priced.loss_fn is self.loss_fn and priced.train == self.train
                and priced.replicated_batch == self.replicated_batch and None not in (priced.strategy, self.strategy)
                and dataclasses.replace(priced.options, compile=self.options.compile) == self.options)
        taken = False
        for (layout, mode), program in priced._compiled.items() if same else ():
            mesh = layout[2]  # the strategies alike on it (``FSDP()`` is ``FSDP(8)`` on 8 devices)
            if priced.strategy.resolved(mesh) == self.strategy.resolved(mesh):
                self._compiled.setdefault((layout, mode), program)
                self.reshardings.setdefault(mode, priced.reshardings.get(mode, []))
                taken = True
        return taken
