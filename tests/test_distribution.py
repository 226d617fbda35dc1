"""The distribution is `parallax-flax`; `import parallax` refuses another project's `parallax` clearly.

Each case runs a fresh interpreter of this environment (where parallax-flax is installed with its
import guard) with a look-alike `parallax` placed first on the path, the way a sibling install of
Google's google-parallax or of the `parallax` SSH tool would shadow it.
"""

import os
import pathlib
import shutil
import subprocess
import sys
from importlib import metadata

import pytest

import parallax

pytestmark = pytest.mark.core

GOOGLE_INIT = '"""Parallax library."""\n\n__version__ = "0.0.2"\n\nfrom flax import nnx\n'
SSH_CALLBACKS = "class DefaultCallbacks(object):\n    pass\n"


def _fake_distribution(site: pathlib.Path, name: str, version: str) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "top_level.txt").write_text("parallax\n")


def _import_parallax(path_first: pathlib.Path, cwd: pathlib.Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(path_first))
    return subprocess.run([sys.executable, "-c", "import parallax; print(parallax.__distribution__)"],
                          env=env, cwd=cwd or path_first, capture_output=True, text=True, timeout=120)


def test_installed_under_its_own_distribution_name():
    assert metadata.version("parallax-flax") == parallax.__version__
    assert parallax.__distribution__ == "parallax-flax"
    # The guard ships with the distribution and is active in every interpreter of this environment.
    assert any(type(finder).__name__ == "ParallaxGuard" for finder in sys.meta_path)


def test_google_parallax_shadowing_ours_is_a_clear_import_error(tmp_path):
    (tmp_path / "parallax").mkdir()
    (tmp_path / "parallax" / "__init__.py").write_text(GOOGLE_INIT)
    _fake_distribution(tmp_path, "google-parallax", "0.0.2")
    result = _import_parallax(tmp_path)
    assert result.returncode != 0
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("ImportError: `import parallax` found ")
    assert str(tmp_path / "parallax" / "__init__.py") in error
    for expected in ("parallax-flax", "google-parallax 0.0.2", "SSH tool", "pip uninstall google-parallax parallax",
                     "pip install --force-reinstall parallax-flax"):
        assert expected in error, (expected, error)
    assert "from flax import nnx" not in result.stderr  # refused before any of its code ran


def test_a_stray_ssh_tool_module_beside_ours_is_harmless(tmp_path):
    """The SSH tool (`pip install parallax` 1.0.6) ships parallax/callbacks.py; ours lives in
    parallax/train/, so only its __init__.py (which the marker check catches) can collide."""
    shutil.copytree(pathlib.Path(parallax.__file__).parent, tmp_path / "parallax",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "parallax" / "callbacks.py").write_text(SSH_CALLBACKS)
    result = _import_parallax(tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "parallax-flax"


def test_files_overwritten_by_another_project_are_named(tmp_path):
    """One of our modules replaced by another project's file (a partial overwrite) is named."""
    shutil.copytree(pathlib.Path(parallax.__file__).parent, tmp_path / "parallax",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "parallax" / "train" / "callbacks.py").write_text(SSH_CALLBACKS)
    _fake_distribution(tmp_path, "parallax", "1.0.6")
    result = _import_parallax(tmp_path)
    assert result.returncode != 0
    error = result.stderr.strip().splitlines()[-1]
    assert "could not import its own modules" in error and "parallax.train.callbacks" in error, error
    assert "parallax 1.0.6" in error and "pip install --force-reinstall parallax-flax" in error, error


def test_an_empty_folder_named_parallax_in_the_working_directory_does_not_shadow(tmp_path):
    (tmp_path / "parallax").mkdir()  # e.g. an output folder: a namespace package, ranked after real ones
    result = _import_parallax(tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "parallax-flax"


def test_ours_imports_normally_from_another_directory(tmp_path):
    result = _import_parallax(tmp_path)  # nothing shadows: the installed parallax-flax is imported
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "parallax-flax"
