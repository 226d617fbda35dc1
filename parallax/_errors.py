"""An exception as one line of another message."""

from __future__ import annotations


def first_line(err: BaseException, limit: int | None = None) -> str:
    """``err``'s message up to its first line break (at most ``limit`` characters), or its type's
    name where it has no message (``str(err)`` of an ``AssertionError()`` is empty).

    Example:
        >>> first_line(ValueError("no stack\\nmore detail")), first_line(AssertionError())
        ('no stack', 'AssertionError')
    """
    lines = str(err).splitlines()
    line = lines[0] if lines and lines[0].strip() else type(err).__name__
    return line if limit is None else line[:limit]
