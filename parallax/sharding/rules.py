"""Tensor-parallel rules: which param paths are column-, row- or vocab-parallel.

A rule is ``(regex, layout)``. The regex is searched in the param's path, rendered as
``"Block_0/attn/query/kernel"``; the first matching rule wins. A layout is one of

* ``"column"``: split the output features. A kernel ``(in, out)`` splits ``out``; a
  ``DenseGeneral`` kernel ``(in, heads, head_dim)`` splits ``heads``; the bias splits its
  first dim.
* ``"row"``: split the input features. A kernel ``(in, out)`` splits ``in``; an
  attention output kernel ``(heads, head_dim, out)`` splits ``heads``; the bias is
  replicated (it is added once, after the reduction).
* ``"vocab"``: split an embedding table ``(vocab, features)`` over the vocabulary,
  falling back to the feature dim when the vocabulary is not divisible.
* ``"replicate"``: keep the param whole on every tensor shard.
* a ``PartitionSpec`` (or tuple) naming mesh axes literally, for anything else, e.g.
  ``P("tensor", None)`` for a PyTorch-style ``(out, in)`` column-parallel kernel.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from jax.sharding import PartitionSpec

Layout = str | PartitionSpec | tuple
Rule = tuple[str, Layout]

LAYOUTS = ("column", "row", "vocab", "replicate")

_COLUMN_NAMES = (
    "q|k|v|query|key|value|wq|wk|wv|q_proj|k_proj|v_proj|qkv|qkv_proj|c_attn|in_proj"
    "|up|gate|up_proj|gate_proj|fc1|wi|wi_0|wi_1|c_fc|w1|w3|intermediate|dense_h_to_4h"
)
_ROW_NAMES = "o|out|proj|o_proj|out_proj|down|down_proj|fc2|wo|c_proj|w2|dense_4h_to_h|attn_out"
_EMBED_NAMES = "embed|embedding|embeddings|wte|tok_embeddings|embed_tokens|token_embedder|word_embeddings"

DEFAULT_RULES: tuple[Rule, ...] = (
    (rf"(^|/)({_COLUMN_NAMES})(_\d+)?/(kernel|bias)$", "column"),
    (rf"(^|/)({_ROW_NAMES})(_\d+)?/(kernel|bias)$", "row"),
    (rf"(^|/)({_EMBED_NAMES})(_\d+)?/embedding$", "vocab"),
)
"""Megatron-style rules for common layer names (flax ``(in, out)`` kernel layout).

Each rule matches a whole path component (optionally numbered: ``up_0``, ``wi_1``), so
``out`` does not also match ``output``.
"""


def validate_rules(rules: Sequence[Rule]) -> tuple[Rule, ...]:
    """Checks the shape of a rule list and compiles nothing yet.

    Raises:
        ValueError: a rule that is not a ``(regex, layout)`` pair, a regex that does
            not compile, or an unknown layout name.
    """
    checked = []
    for rule in rules:
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)):
            raise ValueError(
                f"A tensor-parallel rule must be a (regex, layout) pair, got {rule!r}; "
                "e.g. (r'attn/(q|k|v)/kernel$', 'column')."
            )
        pattern, layout = rule
        try:
            re.compile(pattern)
        except re.error as err:
            raise ValueError(f"Tensor-parallel rule regex {pattern!r} does not compile: {err}.") from None
        if isinstance(layout, str) and layout not in LAYOUTS:
            raise ValueError(
                f"Tensor-parallel rule {pattern!r} has layout {layout!r}; use one of "
                f"{LAYOUTS} or a PartitionSpec."
            )
        if not isinstance(layout, (str, PartitionSpec, tuple)):
            raise ValueError(
                f"Tensor-parallel rule {pattern!r} has layout {layout!r} of type "
                f"{type(layout).__name__}; use one of {LAYOUTS} or a PartitionSpec."
            )
        checked.append((pattern, PartitionSpec(*layout) if isinstance(layout, tuple) else layout))
    return tuple(checked)


def match_rule(path: str, rules: Sequence[Rule]) -> tuple[int, Layout] | None:
    """Returns ``(index, layout)`` of the first rule whose regex is found in ``path``."""
    for index, (pattern, layout) in enumerate(rules):
        if re.search(pattern, path):
            return index, layout
    return None


def layout_dims(layout: str, path: str, shape: tuple[int, ...], axis_size: int) -> list[int]:
    """The dims a named layout would split, in order of preference.

    Example:
        >>> layout_dims("column", "mlp/up/kernel", (64, 256), 2)
        [1]
        >>> layout_dims("row", "attn/out/kernel", (4, 16, 64), 2)
        [0]
    """
    ndim = len(shape)
    leaf = path.rsplit("/", 1)[-1]
    if ndim == 0 or layout == "replicate":
        return []
    if layout == "vocab":
        return [0, ndim - 1] if ndim >= 2 else [0]
    is_bias = leaf == "bias" or ndim == 1
    if layout == "column":
        return [0] if is_bias else [1]
    if layout == "row":
        return [] if is_bias else [0]
    raise ValueError(f"Unknown layout {layout!r}.")  # pragma: no cover - validated earlier
