"""Sphinx configuration for the parallax documentation (``make docs``).

Sphinx with MyST, as JAX, Flax, Optax and Orbax document themselves: the guides are Markdown
that GitHub renders too, and the API reference is generated from the Google-style docstrings
(``sphinx.ext.napoleon``). ``make docs`` builds with warnings as errors.
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# The API pages import parallax: a CPU backend with 8 simulated devices, as in the guides.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

project = "parallax"
author = "the parallax authors"
copyright = "2026, the parallax authors"

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
source_suffix = {".md": "markdown"}
master_doc = "index"
exclude_patterns = ["_build"]
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3
# Links to files of the repository (examples/, benchmarks/...) are not pages of the site.
suppress_warnings = ["myst.xref_missing"]

napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # "Attributes:" as fields of the class, not entries of their own
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": False}

html_theme = "sphinx_book_theme"
html_title = "parallax"
html_theme_options = {"repository_url": "https://github.com/parallax-flax/parallax", "use_repository_button": False,
                      "show_toc_level": 2}
