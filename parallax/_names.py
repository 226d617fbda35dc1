"""Names a person typed (an option, a strategy): the closest of the names allowed, for an error."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(typed: Iterable[str], allowed: Iterable[str]) -> str:
    """``" (did you mean 'max_steps'?)"`` for the first typed name close to an allowed one, else ``""``.

    Example:
        >>> did_you_mean(["max_step"], ["max_steps", "epochs"])
        " (did you mean 'max_steps'?)"
        >>> did_you_mean(["colour"], ["max_steps"])
        ''
    """
    allowed = list(allowed)
    for name in typed:
        close = difflib.get_close_matches(str(name), allowed, n=1, cutoff=0.75)
        if close:
            return f" (did you mean {close[0]!r}?)"
    return ""
