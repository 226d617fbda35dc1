"""Interpreting a jaxpr over the abstract values of :mod:`parallax.jaxpr.per_example.domain`.

This module walks equations, sub-computations, loops and branches, and handles values that
do not read the batch and batch-wide sums; :mod:`.rules` has the rule of each primitive on
per-example values. A primitive no rule knows is fine on values that do not read the batch
and raises :class:`NotPerExample` on any other: the interpretation proves, never guesses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.extend import core

from parallax._compat import scan_counts, source_line
from parallax.jaxpr.per_example import rules
from parallax.jaxpr.per_example.domain import BatchSum, Fixed, NotPerExample, PerExample, Random, fixed_from_array, join
from parallax.jaxpr.per_example.rules import shape as _shape

_CALLS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
# Primitives whose result grows with the size of a dim they run over (a constant summed B times is B).
_SUMMING = {"reduce_sum", "reduce_prod", "dot_general", "cumsum", "cumprod", "cumlogsumexp", "reduce_window_sum",
            "reduce_window", "conv_general_dilated", "argmax", "argmin", "reduce_and", "reduce_or", "reduce_xor"}
_EVALUATE = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "max": np.maximum,
             "min": np.minimum, "neg": np.negative, "sqrt": np.sqrt, "exp": np.exp, "log": np.log,
             "abs": np.abs, "pow": np.power, "rsqrt": lambda x: 1 / np.sqrt(x), "square": np.square,
             "convert_element_type": lambda x: x, "copy": lambda x: x, "copy_p": lambda x: x}


def interpret(closed: Any, inputs: Sequence[Any], signature: list, draws: int | None = None) -> list:
    """The abstract values of a (closed) jaxpr's outputs given its inputs'.

    ``signature`` gets, per equation, its primitive and the literals it reads on values
    that are not batch-wide sums: two traces of one loss at two batch sizes must agree on it.
    ``draws``: where given, the trace's batch rows, and a random draw (``random_bits``) whose
    leading dim is a multiple of them draws per example (a pipeline makes it as one device does;
    accumulation draws each microbatch's rows from its own key), any other one value for every
    example; by default a draw is :class:`~.domain.Random`. A :class:`~.domain.NotPerExample`
    raised names the innermost equation it was raised at (``where``: file, line and function).
    """
    jaxpr, consts = (closed.jaxpr, closed.consts) if isinstance(closed, core.ClosedJaxpr) else (closed, ())
    env: dict = {}
    for var, value in zip(jaxpr.constvars, consts):
        env[var] = fixed_from_array(value)
    for var, value in zip(jaxpr.invars, inputs):
        env[var] = value
    for eqn in jaxpr.eqns:
        try:
            outs = _visit(eqn, [_read(env, v) for v in eqn.invars], signature, draws)
        except NotPerExample as why:
            if why.where is None:
                why.where = source_line(eqn)
            raise
        for var, value in zip(eqn.outvars, outs):
            env[var] = value
    return [_read(env, v) for v in jaxpr.outvars]


def _read(env: dict, var: Any) -> Any:
    if isinstance(var, core.Literal):
        return fixed_from_array(np.asarray(var.val))
    return env[var]


@dataclasses.dataclass(frozen=True)
class Entry:
    """One equation's entry in a trace's signature: what must match between two traces (``key``),
    and the equation (not compared), to say where they differ."""

    key: tuple
    eqn: Any = dataclasses.field(compare=False, repr=False)

    def describe(self) -> str:
        """The primitive and, where the trace says, the source line that made it."""
        where = source_line(self.eqn)
        return f"{self.key[0]}" + (f" at {where}" if where else "")


SYNCED = "psum of a batch-wide sum"  # the signature entry of statistics summed over the data shards


def _synced(name: str, ins: list) -> bool:
    """Batch-wide sums summed over the data shards (BatchNorm's statistics on the shard_map path)."""
    return name == "psum" and all(isinstance(a, BatchSum) for a in ins)


def _record(eqn: Any, ins: list, signature: list) -> None:
    """What must not change between the traces at two batch sizes: the primitive, the literals
    it reads and its operands' shapes, except the example dim of per-example values and the
    dims a batch-free value is constant along (unless the primitive sums over them). An
    equation on a batch-wide sum records only its primitive: a mean's divisor is meant to
    differ, and :func:`parallax.jaxpr.per_example.prove_loss` checks its scale. A batch-free
    value broadcast (a causal mask to the batch's shape) is not recorded: ``jnp.broadcast_to`` emits
    nothing where the shape is already the target's (a batch of one), and what reads the broadcast
    records its shapes (a sum over the broadcast dims among them)."""
    name = eqn.primitive.name
    if name == "broadcast_in_dim" and all(isinstance(a, Fixed) for a in ins):
        return
    if _synced(name, ins):  # prove_loss checks each is a mean
        signature.extend((SYNCED, a.scales, a.offsets) for a in ins)
        return
    if any(isinstance(a, BatchSum) for a in ins):
        signature.append(Entry((name,), eqn))
        return
    literals = tuple(float(np.asarray(v.val).reshape(-1)[0]) for v in eqn.invars
                     if isinstance(v, core.Literal) and np.size(v.val) == 1)
    summing = name in _SUMMING
    shapes = []
    for var, a in zip(eqn.invars, ins):
        masked = {a.dim} if isinstance(a, PerExample) else set() if summing else set(a.uniform)
        shapes.append(tuple(None if d in masked else size for d, size in enumerate(_shape(var))))
    signature.append(Entry((name, literals, tuple(shapes)), eqn))


def _visit(eqn: Any, ins: list, signature: list, draws: int | None) -> list:
    name = eqn.primitive.name
    n_out = len(eqn.outvars)
    if any(isinstance(a, Random) for a in ins):  # no signature: a random value that reaches an output is refused
        return [Random()] * n_out
    _record(eqn, ins, signature)
    if name == "random_bits" and draws is not None:
        rows = (tuple(eqn.params["shape"]) or (0,))[0]
        return [PerExample(0, rows // draws) if rows and rows % draws == 0 else Fixed()]
    if name in ("scan", "while", "cond"):
        return _control(eqn, ins, signature, draws)
    sub = _sub_jaxpr(eqn)
    if sub is not None:
        return interpret(sub, ins, signature, draws)
    if all(isinstance(a, Fixed) for a in ins):
        return _fixed(eqn, ins)
    if _synced(name, ins):  # each shard then holds the whole batch's value, as the global trace
        # does: batch-free from here.
        return [Fixed()] * n_out
    if any(isinstance(a, BatchSum) for a in ins):
        return [_batch_sum(eqn, ins)] * n_out
    per = rules.per_example(eqn, ins)
    return per if isinstance(per, list) else [per] * n_out


def _sub_jaxpr(eqn: Any):
    if eqn.primitive.name == "pallas_call":  # a kernel's body runs on refs, once per cell: rules._kernel
        return None
    for key in _CALLS:
        sub = eqn.params.get(key)
        jaxpr = sub.jaxpr if isinstance(sub, core.ClosedJaxpr) else sub
        if isinstance(jaxpr, core.Jaxpr) and len(jaxpr.invars) == len(eqn.invars):
            return sub
    return None


def _fixed(eqn: Any, ins: list) -> list:
    """Every input batch-free: the outputs are too; keep which dims are uniform and known values."""
    name, params = eqn.primitive.name, eqn.params
    out_shape = _shape(eqn.outvars[0]) if eqn.outvars else ()
    rank = len(out_shape)
    if name == "iota":
        return [Fixed(frozenset(range(rank)) - {params["dimension"]})]
    if name == "broadcast_in_dim":
        (operand,), dims = ins[:1], params["broadcast_dimensions"]
        in_shape = _shape(eqn.invars[0])
        uniform = {d for d in range(rank) if d not in dims}
        uniform |= {dims[i] for i in range(len(dims)) if i in operand.uniform or in_shape[i] == 1}
        return [Fixed(frozenset(uniform), operand.value)]
    if name in rules.ELEMENTWISE and eqn.outvars:
        uniform = frozenset(range(rank))
        for var, a in zip(eqn.invars, ins):
            if len(_shape(var)) == rank:  # a size-1 dim broadcasts: constant along it
                uniform &= a.uniform | {d for d in range(rank) if _shape(var)[d] == 1 < out_shape[d]}
        value = None
        if name in _EVALUATE and all(a.value is not None for a in ins):
            with np.errstate(all="ignore"):
                value = float(np.asarray(_EVALUATE[name](*[np.float64(a.value) for a in ins])))
        elif name == "integer_pow" and ins[0].value is not None:
            value = float(ins[0].value) ** params["y"]
        return [Fixed(uniform, value)] * len(eqn.outvars)
    if name == "reduce_sum" and ins[0].value is not None:
        size = int(np.prod([_shape(eqn.invars[0])[a] for a in params["axes"]]))
        return [Fixed(frozenset(range(rank)), ins[0].value * size)]
    if name in ("reduce_max", "reduce_min") and ins[0].value is not None:
        return [Fixed(frozenset(range(rank)), ins[0].value)]
    return [Fixed(frozenset(dims)) for dims in _uniform_through(eqn, ins)]


def _uniform_through(eqn: Any, ins: list) -> list[set]:
    """Which output dims stay constant: where the per-example rules send an input's constant dim
    (a dim that keeps each slice to itself keeps a constant slice constant)."""
    found: list[set] = [set() for _ in eqn.outvars]
    for index, a in enumerate(ins):
        for dim in a.uniform:
            trial = list(ins)
            trial[index] = PerExample(dim)
            try:
                outs = rules.per_example(eqn, trial)
            except (NotPerExample, KeyError, ValueError, IndexError, TypeError):
                continue
            for out, value in zip(found, outs if isinstance(outs, list) else [outs] * len(found)):
                if isinstance(value, PerExample) and value.block == 1:
                    out.add(value.dim)
    return found


def _batch_sum(eqn: Any, ins: list) -> BatchSum:
    """Linear maps of a batch-wide sum stay one; anything else mixes examples."""
    name = eqn.primitive.name
    if any(isinstance(a, PerExample) for a in ins):
        raise NotPerExample(f"it feeds a batch-wide sum back into per-example values ({name})")
    sums = [a for a in ins if isinstance(a, BatchSum)]
    fixed = [a for a in ins if isinstance(a, Fixed)]
    if name in ("reduce_sum", "transpose", "reshape", "squeeze", "expand_dims") or name in rules.IDENTITY:
        return sums[0]
    if name == "broadcast_in_dim":
        if int(np.prod(_shape(eqn.outvars[0]))) != int(np.prod(_shape(eqn.invars[0]))):
            raise NotPerExample("it broadcasts a batch-wide sum")
        return sums[0]
    if name in ("stack", "concatenate") and len(sums) == len(ins):  # several sums side by side (only summed or
        return BatchSum(tuple(x for a in sums for x in a.scales),   # synced from here: see psum)
                        tuple(x for a in sums for x in a.offsets))
    if name in ("add", "add_any", "sub"):
        scales, offsets = [], []
        for index, a in enumerate(ins):
            sign = -1.0 if name == "sub" and index else 1.0
            if isinstance(a, BatchSum):
                scales += _scaled(a.scales, sign)
                offsets += _scaled(a.offsets, sign)
            else:
                offsets.append(sign)  # a term that does not read the batch
        return BatchSum(tuple(scales), tuple(offsets))
    if name == "neg":
        return BatchSum(_scaled(sums[0].scales, -1.0), _scaled(sums[0].offsets, -1.0))
    if name in ("mul", "div") and len(sums) == 1 and len(fixed) == 1:
        if name == "div" and isinstance(ins[1], BatchSum):
            raise NotPerExample("it divides by a batch-wide sum (a count over the batch)")
        factor = fixed[0].value
        if factor is not None and name == "div":
            factor = 1.0 / factor
        return BatchSum(_scaled(sums[0].scales, factor), _scaled(sums[0].offsets, factor))
    if name in ("mul", "div"):
        raise NotPerExample(f"it {'multiplies' if name == 'mul' else 'divides'} batch-wide sums together "
                            "(a ratio or product of sums over the batch)")
    raise NotPerExample(f"it applies {name} to a batch-wide sum (batch statistics, e.g. BatchNorm's)")




def _control(eqn: Any, ins: list, signature: list, draws: int | None) -> list:
    """``scan``/``while``: the carry iterated to a fixed point; ``cond``: its branches joined."""
    name, params = eqn.primitive.name, eqn.params
    if name == "cond":
        if not isinstance(ins[0], Fixed):
            raise NotPerExample("it branches on a value computed from the batch")
        outs = None
        for branch in params["branches"]:
            found = interpret(branch, ins[1:], signature, draws)
            outs = found if outs is None else [join(a, b) for a, b in zip(outs, found)]
        return outs
    if name == "scan":
        consts, n_carry = scan_counts(params)
        fixed_in, carry, xs = ins[:consts], ins[consts:consts + n_carry], ins[consts + n_carry:]
        body = params["jaxpr"]
        sliced = [rules.unstacked(x) for x in xs]
        for _ in range(4):
            outs = interpret(body, fixed_in + carry + sliced, [], draws)
            joined = [join(a, b) for a, b in zip(carry, outs[:n_carry])]
            if joined == carry:
                interpret(body, fixed_in + carry + sliced, signature, draws)
                return carry + [rules.stacked(y) for y in outs[n_carry:]]
            carry = joined
        raise NotPerExample("a scan's carry does not settle")
    cond, body = params["cond_jaxpr"], params["body_jaxpr"]
    cond_consts, body_consts = ins[:params["cond_nconsts"]], ins[params["cond_nconsts"]:][:params["body_nconsts"]]
    carry = ins[params["cond_nconsts"] + params["body_nconsts"]:]
    for _ in range(4):
        joined = [join(a, b) for a, b in zip(carry, interpret(body, body_consts + carry, [], draws))]
        if joined == carry:
            break
        carry = joined
    else:
        raise NotPerExample("a while loop's carry does not settle")
    (predicate,) = interpret(cond, cond_consts + carry, signature, draws)
    if not isinstance(predicate, Fixed):
        raise NotPerExample("a while loop's condition reads the batch")
    interpret(body, body_consts + carry, signature, draws)
    return carry


def _scaled(factors: tuple, by: float | None) -> tuple:
    """Literal factors times ``by``; unknown (``None``) where either is."""
    return tuple(None if f is None or by is None else f * by for f in factors)
