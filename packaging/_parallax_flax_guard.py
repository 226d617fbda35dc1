"""Makes ``import parallax`` fail clearly when it would import another project's ``parallax``.

Three PyPI distributions install a top-level module named ``parallax``: this library
(``parallax-flax``), Google's ``google-parallax`` (NNX auto-sharding) and ``parallax`` (an SSH
tool). Whichever comes first on ``sys.path``, or was installed last into the same
``site-packages``, wins, and the user would otherwise meet an ``AttributeError`` on
``px.Trainer`` far from the cause. ``parallax-flax`` installs this module and a one-line
``.pth`` file that calls :func:`install` at interpreter start-up (the mechanism setuptools
uses for ``distutils-precedence.pth``). The finder does nothing for any other module name
and never imports ``parallax`` itself: it asks the other finders where ``parallax`` is and
reads the first lines of that ``__init__.py`` for this library's marker.

This file sits outside the ``parallax`` package on purpose: importing anything from the
package would first import whichever ``parallax`` is found.
"""

from __future__ import annotations

import importlib.abc
import sys

DISTRIBUTION = "parallax-flax"
MARKER = f'__distribution__ = "{DISTRIBUTION}"'
_KNOWN = {
    "google-parallax": "Google's google-parallax (NNX auto-sharding)",
    "parallax": "the `parallax` SSH tool",
}


def other_distributions() -> list[str]:
    """Names and versions of installed distributions, other than ours, that provide ``parallax``."""
    from importlib import metadata

    names = metadata.packages_distributions().get("parallax", [])
    found = []
    for name in sorted(set(names)):
        if name.lower().replace("_", "-") == DISTRIBUTION:
            continue
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(name)
    return found


def conflict_message(problem: str) -> str:
    """The error text: ``problem`` (what was found), which projects clash, and the fix."""
    others = other_distributions()
    installed = (f"Installed here besides parallax-flax: {', '.join(others)}. "
                 if others else "")
    return (
        f"{problem} parallax-flax is the Flax training library (PyPI: `{DISTRIBUTION}`); "
        "two other projects install a module named `parallax`: "
        f"{_KNOWN['google-parallax']} and {_KNOWN['parallax']}. {installed}"
        "Fix: remove the other one and reinstall ours "
        f"(`pip uninstall google-parallax parallax && pip install --force-reinstall {DISTRIBUTION}`), "
        "or keep them in separate virtual environments; a folder named `parallax` in the "
        "working directory or on PYTHONPATH also shadows the installed library."
    )


def is_ours(init_file: str) -> bool:
    """Whether the ``parallax/__init__.py`` at ``init_file`` carries parallax-flax's marker."""
    try:
        with open(init_file, encoding="utf-8") as handle:
            head = handle.read(4096)
    except OSError:
        return False
    return MARKER in head


class ParallaxGuard(importlib.abc.MetaPathFinder):
    """A meta-path finder that only checks, never loads, the top-level ``parallax`` module."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "parallax":
            return None
        for finder in sys.meta_path:
            if finder is self or isinstance(finder, ParallaxGuard) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if not spec.has_location or not spec.origin or not spec.origin.endswith(".py"):
            return spec  # a namespace folder: Python only uses it when no real package exists
        if not is_ours(spec.origin):
            raise ImportError(conflict_message(f"`import parallax` found {spec.origin}, which is not parallax-flax."),
                              name="parallax", path=spec.origin)
        return spec


def install() -> None:
    """Puts the guard first on ``sys.meta_path`` (idempotent)."""
    if not any(isinstance(finder, ParallaxGuard) for finder in sys.meta_path):
        sys.meta_path.insert(0, ParallaxGuard())
