"""The stack a model scans over its params, found in its traced computation and run as a pipeline.

Most model code stacks its repeated blocks: linen ``nn.scan`` over a block with its params on a
leading axis, NNX ``nnx.vmap`` + ``nnx.scan``, or a plain ``lax.scan``. Traced, each is one
``scan`` whose stepped-over operands (``xs``) are params, whose carry is the activations (the
batch on its leading dim), and whose constants are either per-example values (masks,
positions: the batch on their leading dim) or values every layer shares. :func:`pipelined`
re-runs a function's traced computation with every such ``scan`` replaced by
:func:`parallax.parallel.pipeline.schedule.pipeline` over the same per-layer body, so the model's code runs
unchanged and everything before and after its stack (embeddings, head, loss) runs as before.

Example:
    >>> mesh = jax.sharding.Mesh(jax.devices()[:2], ("stage",))
    >>> def forward(w, x):
    ...     return jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), x, w)[0].sum()
    >>> w, x = jnp.ones((4, 3, 3)) / 3, jnp.ones((8, 3))
    >>> piped = pipelined(forward, mesh=mesh, axis="stage", microbatches=2)
    >>> bool(jnp.allclose(piped(w, x), forward(w, x)))
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax.extend import core
from jax.sharding import Mesh

from parallax._compat import scan_counts
from parallax.jaxpr.chains import CALLS, REMAT, Chain, call_body, find_chains, folded_constants, use_counts
from parallax.jaxpr.rebind import bind_eqn
from parallax.models.remat_policy import rematerialises
from parallax.parallel.pipeline.layer import RANDOM_BITS, Draws, in_context, layer_draws, layer_mesh
from parallax.parallel.pipeline.part import NoStackError
from parallax.parallel.pipeline.rows import BATCH, check_per_example, per_example_operands
from parallax.parallel.pipeline.schedule import pipeline
from parallax.parallel.pipeline.stacked_blocks import cast_rows, restacked, unstacked

PARAMS, STATE, _INLINED = "params", "state", CALLS  # what values come from (and BATCH); calls opened to a stack


@dataclasses.dataclass(frozen=True)
class Stack:
    """How :func:`pipelined` runs the stacks it finds (its arguments, the microbatch count fixed)."""
    mesh: Mesh
    axis: str
    microbatches: int
    repeats: int = 1
    policy: Any = None
    prove: Callable | None = None
    keep_layer_inputs: bool = False
    marked: bool = False
    held: Any = None  # id of a slice of a stacked param → (that param, its row, the slice)


def pipelined(fn: Callable, *, mesh: Mesh, axis: str, microbatches: int | Callable[[int], int], repeats: int = 1,
              policy: Any = None, params_argnum: int = 0, batch_argnums: Sequence[int] = (1,),
              state_argnums: Sequence[int] = (), prove: Callable | None = None,
              keep_layer_inputs: bool = False, marked: bool = False) -> Callable:
    """``fn`` with each stack it scans over its params run as a pipeline over ``mesh``'s ``axis``.

    Args:
        fn: the function (a model's forward pass, a loss).
        mesh, axis, repeats, policy: as :func:`parallax.parallel.pipeline.schedule.pipeline` takes them.
        microbatches: the microbatch count, or a function of the batch's rows that gives it.
        params_argnum: the argument holding the params.
        batch_argnums: the arguments holding the batch (every leaf with the batch on its leading dim).
        state_argnums: the arguments holding the model's mutable state (BatchNorm statistics):
            a stack that updates it is refused by name.
        prove: proves each layer computes every example on its own, so that microbatches
            compute what the batch does (:func:`parallax.parallel.pipeline.rows.prove_layer`,
            passed in by the step); a layer it does not prove is refused, naming the operation.
        keep_layer_inputs: where the blocks checkpoint themselves, keep each one's input too: each
            recomputed once, not twice (``PipelineParallel(remat="layer")``).
        marked: each call of a list of blocks is a checkpoint parallax made to find them; else the
            model's own (``nn.remat``, ``remat=``), kept around each block, as in a stack.

    Returns:
        A function of the same arguments, returning what ``fn`` returns.

    Raises:
        ValueError: a stack cannot be pipelined (the message names what and the fix), or there is none.
    """
    def run(*args: Any) -> Any:
        held: dict = {}  # a list of blocks held stacked (parallax.parallel.pipeline.stacked_blocks): its slices' rows
        args = tuple(unstacked(arg, held) if i == params_argnum else arg for i, arg in enumerate(args))
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        kinds = [frozenset({PARAMS} if i == params_argnum else {BATCH} if i in batch_argnums
                           else {STATE} if i in state_argnums else ()) for i, arg in enumerate(args)
                 for _ in jax.tree.leaves(arg)]
        # The layer at a microbatch's shape: a jaxpr's shapes are fixed, so trace fn on a microbatch too.
        rows = {int(jax.numpy.shape(leaf)[0]) for i in batch_argnums for leaf in jax.tree.leaves(args[i])}
        count = microbatches(min(rows)) if callable(microbatches) else microbatches
        if len(rows) != 1 or min(rows) % count:
            raise ValueError(f"microbatches={count} must divide the batch, whose leaves have leading dims "
                             f"{sorted(rows)}: use one batch size, and a divisor of it.")
        stack = Stack(mesh, axis, count, repeats, policy, prove, keep_layer_inputs, marked, held)
        # Shapes alone, traced with no mesh in context: the layer then records no mesh (its values'
        # types would name the mesh with the stage axis automatic, which the pipeline makes manual).
        def shape_of(x: Any, batch: bool) -> jax.ShapeDtypeStruct:
            shape = jax.numpy.shape(x)
            return jax.ShapeDtypeStruct((min(rows) // count, *shape[1:]) if batch else shape, jax.numpy.result_type(x))

        micro = [jax.tree.map(lambda x, b=i in batch_argnums: shape_of(x, b), arg) for i, arg in enumerate(args)]
        with jax.sharding.use_abstract_mesh(layer_mesh(mesh, axis)):
            traced = jax.make_jaxpr(fn)(*micro)
            bodies = _stack_bodies(traced.jaxpr, kinds, traced.consts)[0]
            # For the proof, the layers at the batch's shape traced alike (the same context, no mesh).
            wholes = [None] * len(bodies)
            if prove is not None:
                batch = jax.make_jaxpr(fn)(*[jax.tree.map(lambda x: shape_of(x, False), arg) for arg in args])
                wholes = _stack_bodies(batch.jaxpr, kinds, batch.consts)[0]
        if not bodies:
            raise NoStackError(
                "No stack of blocks to pipeline: the traced computation has no scan over stacked params with the "
                "activations as its carry. Stack the repeated blocks (linen nn.scan with variable_axes={'params': 0}, "
                "NNX nnx.vmap + nnx.scan, or a lax.scan over stacked weights).")
        outs, _ = _evaluate(closed.jaxpr, closed.consts, jax.tree.leaves(args), kinds, stack,
                            iter(list(zip(bodies, wholes, strict=True))))
        return jax.tree.unflatten(jax.tree.structure(shape), outs)

    return run


def _stack_bodies(jaxpr: Any, kinds: Sequence[frozenset],
                  consts: Sequence[Any] = ()) -> tuple[list[Any], list[frozenset]]:
    """The layer (the scan's body) of each stack in ``jaxpr``, in the order they run, and the
    kinds of its outputs: every value's kinds found as :func:`_evaluate` finds them, so that both
    see the same stacks."""
    kind_of = dict(zip(jaxpr.invars, kinds))
    kind = lambda v: frozenset() if isinstance(v, core.Literal) else kind_of.get(v, frozenset())
    starts = {chain.calls[0]: chain for chain in _chains(jaxpr, kinds, consts)}
    found = []
    for index, eqn in enumerate(jaxpr.eqns):
        in_kinds = [kind(v) for v in eqn.invars]
        if index in starts:
            found.append(core.ClosedJaxpr(*call_body(eqn)))
        if eqn.primitive.name == "scan" and _is_stack(eqn, in_kinds):
            found.append(eqn.params["jaxpr"])
            out_kinds = [frozenset({PARAMS, BATCH})] * len(eqn.outvars)
        elif eqn.primitive.name in _INLINED and _holds_stack(eqn):
            inner_jaxpr, inner_consts = call_body(eqn)
            inner_found, out_kinds = _stack_bodies(inner_jaxpr, in_kinds, inner_consts)
            found += inner_found
        else:
            out_kinds = [frozenset().union(*in_kinds)] * len(eqn.outvars)
        kind_of.update(zip(eqn.outvars, out_kinds))
    return found, [kind(v) for v in jaxpr.outvars]


def _chains(jaxpr: Any, kinds: Sequence[frozenset], consts: Sequence[Any]) -> list[Chain]:
    """The lists of identical blocks called in turn in ``jaxpr`` (:mod:`parallax.jaxpr.chains`),
    every value's kinds read as the union of its operands'."""
    kind_of = dict(zip(jaxpr.invars, kinds))
    for eqn in jaxpr.eqns:
        union = frozenset().union(*(kind_of.get(v, frozenset()) for v in eqn.invars if not isinstance(v, core.Literal)))
        kind_of.update((v, union) for v in eqn.outvars)
    return find_chains(jaxpr, lambda v: kind_of.get(v) == {PARAMS}, consts)


def _evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], kinds: Sequence[frozenset], stack: Stack,
              bodies: Iterator[Any], draws: Draws | None = None,
              folds: dict[int, Any] | None = None) -> tuple[list[Any], list[frozenset]]:
    """Evaluates ``jaxpr``, each stack scan run by the pipeline on the next of ``bodies``; every
    value's kinds tracked; inside a layer, its random draws made as one device makes them (``draws``)
    and the equations in ``folds`` folding that value into their key instead of their constant."""
    values: dict[Any, Any] = {}
    kind_of: dict[Any, frozenset] = {}
    for var, value in zip(jaxpr.constvars, consts):
        values[var], kind_of[var] = value, frozenset()
    for var, value, kind in zip(jaxpr.invars, args, kinds):
        values[var], kind_of[var] = value, kind
    read = lambda v: v.val if isinstance(v, core.Literal) else values[v]
    kind = lambda v: frozenset() if isinstance(v, core.Literal) else kind_of[v]
    uses = use_counts(jaxpr)
    used = set(uses)
    chains = _chains(jaxpr, kinds, consts)
    ends = {chain.calls[-1]: chain for chain in chains}
    inside = {index for chain in chains for index in chain.calls[:-1]}
    for index, eqn in enumerate(jaxpr.eqns):
        if index in inside:  # run with the chain's last call
            continue
        name = eqn.primitive.name
        if index in ends:
            chain = ends[index]
            outs = _run_chain(chain, [jaxpr.eqns[i] for i in chain.calls], read, kind, uses, stack, next(bodies))
            for var, value in zip(eqn.outvars, outs):
                values[var], kind_of[var] = value, frozenset({PARAMS, BATCH})
            continue
        ins, in_kinds = [read(v) for v in eqn.invars], [kind(v) for v in eqn.invars]
        if folds and index in folds:  # this block's own key constant
            ins = [ins[0], folds[index]]
        if draws is not None and name == RANDOM_BITS:
            outs, out_kinds = [draws.draw(eqn, *ins)], [frozenset().union(*in_kinds)]
        elif draws is not None and draws.opens(eqn):  # a call holding a per-example draw, run here (a
            inner_jaxpr, inner_consts = call_body(eqn)  # jax.checkpoint kept, with its policy)
            opened = lambda *a: _evaluate(inner_jaxpr, inner_consts, a, in_kinds, stack, bodies, draws)[0]  # noqa: B023 (called in this iteration)
            if name in REMAT:
                opened = jax.checkpoint(opened, prevent_cse=eqn.params["prevent_cse"], policy=eqn.params["policy"])
            outs = opened(*ins)
            out_kinds = [frozenset().union(*in_kinds)] * len(outs)
        elif name == "scan" and _is_stack(eqn, in_kinds):
            outs = _run_stack(eqn, ins, in_kinds, used, stack, next(bodies))
            out_kinds = [frozenset({PARAMS, BATCH})] * len(eqn.outvars)
        elif name in _INLINED and _holds_stack(eqn):
            outs, out_kinds = _evaluate(*call_body(eqn), ins, in_kinds, stack, bodies)
        else:
            # Bound in the context it runs in (not the one recorded at tracing: inside the pipeline's
            # shard_map the stage axis is manual, where the layer was traced with it automatic).
            outs = cast_rows(stack.held, eqn, ins, bind_eqn(eqn, ins))
            out_kinds = [frozenset().union(*in_kinds)] * len(outs)
        for var, value, k in zip(eqn.outvars, outs, out_kinds):
            values[var], kind_of[var] = value, k
    return [read(v) for v in jaxpr.outvars], [kind(v) for v in jaxpr.outvars]


def _split(eqn: Any, items: Sequence[Any]) -> tuple[list, list, list]:
    num_consts, num_carry = scan_counts(eqn.params)
    return (list(items[:num_consts]), list(items[num_consts:num_consts + num_carry]),
            list(items[num_consts + num_carry:]))


def _is_stack(eqn: Any, in_kinds: Sequence[frozenset]) -> bool:
    """A scan over stacked params (some of its xs are params alone) carrying the activations."""
    _, carry, xs = _split(eqn, in_kinds)
    return any(k == {PARAMS} for k in xs) and any(BATCH in k for k in carry)


def _holds_stack(eqn: Any) -> bool:
    inner = call_body(eqn)[0]
    return inner is not None and any(e.primitive.name in ("scan", *_INLINED) for e in inner.eqns)


def _run_stack(eqn: Any, ins: Sequence[Any], in_kinds: Sequence[frozenset], used: set, stack: Stack,
               body: Any) -> list[Any]:
    """The scan ``eqn`` over ``ins``, run by the pipeline with ``body`` (its layer at a microbatch's
    shape, and at the batch's traced alike, for the proof): its carry out, then its per-layer outputs
    (those the model reads combined from the microbatches as the proof says, zeros for the others)."""
    body, whole = body
    params = eqn.params
    consts, carry, xs = _split(eqn, ins)
    const_kinds, carry_kinds, xs_kinds = _split(eqn, in_kinds)
    if params.get("reverse"):
        raise ValueError("The stack's scan runs its layers in reverse (reverse=True): a pipeline runs them in order; "
                         "scan them forward to pipeline them.")
    if any(STATE in k for k in (*xs_kinds, *carry_kinds)):
        raise ValueError(
            "The stack's layers update state of their own (e.g. BatchNorm statistics, or a cache): a pipeline runs "
            "each layer once per microbatch, so they would not be updated as on one device. Use a normalisation "
            "without batch statistics in the blocks (LayerNorm, RMSNorm), or train without PipelineParallel.")
    if any(BATCH in k for k in xs_kinds):
        raise ValueError(
            "The stack's scan steps over values computed from the batch (a scanned input per layer): a pipeline steps "
            "over the blocks' params and per-layer values (random keys) and splits only the carried activations into "
            "microbatches. Pass such values as the carry, or compute them inside the blocks, to pipeline them.")
    if any(BATCH not in k for k in carry_kinds):
        raise ValueError(
            "The stack's scan carries a value that is not per example (an accumulator, e.g. an auxiliary loss summed "
            "over the layers): a pipeline passes only the activations from stage to stage. Return such values per "
            "layer and sum them after the stack, or leave them out, to pipeline it.")
    rows = {int(x.shape[0]) for x in carry}
    per_example = per_example_operands(range(len(consts)), consts, const_kinds, body, rows, "The stack's layers")
    ys = eqn.outvars[len(carry):]
    read = [j for j, v in enumerate(ys) if v in used]  # per-layer outputs the model reads (an auxiliary loss)
    flags = [i in per_example for i in range(len(consts))] + [True] * len(carry) + [False] * len(xs)
    kinds = check_per_example(stack.prove, stack.microbatches, whole, body, flags, min(rows), range(len(carry)),
                              "The stack's layers", [len(carry) + j for j in read])
    shared = [c for i, c in enumerate(consts) if i not in per_example]
    draws, rows_of = layer_draws(body, params["jaxpr"], min(rows), stack.microbatches)

    def layer(w: list, h: list, c: list, s: list) -> tuple[list, list]:
        it_c, it_s = iter(c), iter(s)
        ordered = [next(it_c) if i in per_example else next(it_s) for i in range(len(consts))]
        outs = _run_body(body, [*ordered, *h, *w], stack, draws(c))
        return outs[:len(h)], [outs[len(h) + j] for j in read]

    # The stack's xs: the layers' params and any other per-layer values (a random key per layer).
    out, per_layer = pipeline(layer, list(xs), list(carry), [consts[i] for i in per_example] + rows_of, shared,
                              mesh=stack.mesh, axis=stack.axis, microbatches=stack.microbatches, repeats=stack.repeats,
                              policy=stack.policy, per_layer=kinds,
                              layer_remat=stack.keep_layer_inputs and rematerialises(body.jaxpr))
    found = dict(zip(read, per_layer))
    return list(out) + [found[j] if j in found else jax.numpy.zeros(v.aval.shape, v.aval.dtype)
                        for j, v in enumerate(ys)]


def _run_chain(chain: Chain, calls: Sequence[Any], read: Callable, kind: Callable, uses: dict, stack: Stack,
               body: Any) -> list[Any]:
    """A list of identical blocks called in turn, run by the pipeline with ``body`` (one call at a
    microbatch's shape, and at the batch's traced alike, for the proof) on their params stacked: the
    last call's outputs."""
    body, whole = body
    first, last = calls[0], calls[-1]
    if any(BATCH in kind(eqn.invars[p]) or STATE in kind(eqn.invars[p]) for eqn in calls for p in chain.varying):
        raise ValueError(
            "The blocks read a value computed from the batch that differs from block to block (not the activations "
            "one block passes the next): a pipeline splits only the activations into microbatches. Compute it inside "
            "the blocks, or pass it on as the activations, to pipeline them.")
    for eqn in calls[:-1]:
        if any(uses.get(v, 0) != 1 for v in (eqn.outvars[q] for q in chain.carry_out)):
            raise ValueError(
                "The model reads a block's output besides the next block (e.g. every layer's hidden states, "
                "output_hidden_states=True): a pipeline returns only the last block's. Leave those outputs unread to "
                "pipeline the blocks.")
    if any(uses.get(v, 0) for eqn in calls for q, v in enumerate(eqn.outvars) if q not in chain.carry_out):
        raise ValueError(
            "The model reads an output of the blocks besides the activations (attention weights, a cache): a pipeline "
            "returns only the activations. Leave those outputs unread (e.g. output_attentions=False, use_cache=False) "
            "to pipeline the blocks.")
    operands = [read(v) for v in first.invars]
    kinds = [kind(v) for v in first.invars]
    if any(STATE in k for k in kinds):
        raise ValueError(
            "The blocks update state of their own (e.g. BatchNorm statistics, or a cache): a pipeline runs each block "
            "once per microbatch, so they would not be updated as on one device. Use a normalisation without batch "
            "statistics (LayerNorm, RMSNorm), or train without PipelineParallel.")
    if any(BATCH not in kinds[p] for p in chain.carry):
        raise ValueError("The blocks pass on a value that is not per example: a pipeline passes only the activations.")
    # Stepped over: each block's params, values that differ per block (a key; constants linen folds into keys).
    stepped = (*chain.weights, *chain.varying)
    weights = [restacked([read(eqn.invars[p]) for eqn in calls], stack.held) for p in stepped]
    if chain.folded:
        weights.append(jax.numpy.asarray([[folded_constants(call_body(eqn)[0])[i] for i in chain.folded]
                                          for eqn in calls], jax.numpy.uint32))
    rest = [p for p in range(len(operands)) if p not in stepped and p not in chain.carry]
    rows = {int(operands[p].shape[0]) for p in chain.carry}
    per_example = per_example_operands(rest, operands, kinds, body, rows, "The blocks")
    shared = [p for p in rest if p not in per_example]
    flags = [p in chain.carry or p in per_example for p in range(len(operands))]
    check_per_example(stack.prove, stack.microbatches, whole, body, flags, min(rows), chain.carry_out, "The blocks")
    draws, rows_of = layer_draws(body, core.ClosedJaxpr(*call_body(first)), min(rows), stack.microbatches)

    def layer(w: list, h: list, c: list, s: list) -> list:
        ordered = list(operands)
        for positions, given in ((stepped, w), (chain.carry, h), (per_example, c), (shared, s)):
            for p, value in zip(positions, given):
                ordered[p] = value
        folds = dict(zip(chain.folded, w[-1])) if chain.folded else {}
        outs = _run_body(body, ordered, stack, draws(c), folds)
        return [outs[q] for q in chain.carry_out]

    # The calls' checkpoint: the model's own, kept as a stack's scan keeps it; parallax's mark, for remat="layer".
    if stack.keep_layer_inputs or not stack.marked:
        layer = jax.checkpoint(layer, prevent_cse=first.params["prevent_cse"], policy=first.params["policy"])
    out = pipeline(layer, weights, [operands[p] for p in chain.carry], [operands[p] for p in per_example] + rows_of,
                   [operands[p] for p in shared], mesh=stack.mesh, axis=stack.axis, microbatches=stack.microbatches,
                   repeats=stack.repeats, policy=stack.policy, layer_remat=stack.keep_layer_inputs)
    results = [jax.numpy.zeros(v.aval.shape, v.aval.dtype) for v in last.outvars]
    for q, value in zip(chain.carry_out, out):
        results[q] = value
    return results


def _run_body(body: Any, operands: Sequence[Any], stack: Stack, draws: Draws | None = None,
              folds: dict[int, Any] | None = None) -> list[Any]:
    """``body`` (one layer, traced at a microbatch's shape) on ``operands``, bound in the context it
    runs in: inside the pipeline, where the stage axis is manual; its draws made by ``draws``, and
    its equations in ``folds`` folding that value into their key instead of their constant."""
    here = in_context(body.jaxpr, jax.sharding.get_abstract_mesh())
    return _evaluate(here, body.consts, operands, [frozenset()] * len(operands), stack, iter(()), draws, folds)[0]
