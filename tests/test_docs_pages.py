"""Every code block in the README and the documentation runs; the site builds without a warning."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import parallax as px
from tests.environment import child_env

pytestmark = pytest.mark.wide("the docs pages' code and the site, run as a reader runs them")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")


def toctree_pages() -> list[str]:
    """The site's pages in the order its navigation lists them (``docs/index.md``'s toctrees)."""
    with open(os.path.join(DOCS, "index.md")) as f:
        index = f.read()
    names = [line.strip() for tree in re.findall(r"```\{toctree\}\n(.*?)```", index, re.S)
             for line in tree.splitlines() if line.strip() and not line.startswith(":")]
    return [f"docs/{name}.md" for name in names]


# The README, then Getting started (whose model and data the guides continue from), then the rest.
PAGES = ["README.md", "docs/getting-started.md", "docs/index.md",
         *[page for page in toctree_pages() if page != "docs/getting-started.md"]]
TEXT = {page: open(os.path.join(ROOT, page)).read() for page in PAGES}  # noqa: SIM115 (read in a comprehension)


def blocks(info: str, page: str | None = None) -> list[str]:
    """The code blocks fenced as ``info``, of one page or of every page in order."""
    return [block for name in ([page] if page else PAGES)
            for block in re.findall(rf"```{info}\n(.*?)```", TEXT[name], re.S)]


@pytest.mark.core
def test_every_page_is_in_the_navigation():
    pages = {os.path.relpath(os.path.join(folder, name), ROOT) for folder, _, names in os.walk(DOCS)
             if "_build" not in folder for name in names if name.endswith(".md")}
    assert pages == set(PAGES) - {"README.md"}, sorted(pages ^ (set(PAGES) - {"README.md"}))


def clean_env(devices=None, **extra):
    return child_env(devices, JAX_PLATFORMS="cpu", **extra)


@pytest.mark.budget(150, "every python block of the README and the docs (22 pages; the pipeline guide trains two "
                         "models), run in order in one process: what the pages promise (115-146 s cold)")
def test_python_blocks_run_in_order(tmp_path):
    script = tmp_path / "pages.py"
    script.write_text("\n".join(f"print('==> {page}', flush=True)\n" + "\n".join(blocks("python", page))
                                for page in PAGES))
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env=clean_env(8))
    failed_in = re.findall(r"^==> (.*)$", proc.stdout, re.M)[-1:]
    assert proc.returncode == 0, f"a block of {failed_in} failed:\n{proc.stderr[-4000:]}"
    assert "'accuracy'" in proc.stdout and "\n30\n" in proc.stdout


@pytest.mark.launch
def test_multiprocess_snippet_matches_one_process(tmp_path):
    (snippet,) = blocks("python multiprocess")
    script = tmp_path / "multiprocess.py"
    script.write_text(snippet)
    proc = subprocess.run([sys.executable, "-m", "parallax.launch", "--processes", "2", "--devices-per-process", "4",
                           "--timeout", "500", str(script)], cwd=ROOT, env=clean_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    two_processes = eval(re.search(r"\[0\] losses (\[.*\])", proc.stdout).group(1))
    assert "[1] losses" not in proc.stdout

    # The same training in this one process, on its 8 devices.
    body = snippet[snippet.index("import flax.linen as nn"):]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(body, "README-multiprocess", "exec"),
             {"__name__": "readme", "px": px, "processes": px.distributed.initialize()})
    one_process = eval(re.search(r"losses (\[.*\])", printed.getvalue()).group(1))
    assert len(two_processes) == 10
    np.testing.assert_allclose(two_processes, one_process, atol=2e-6)


@pytest.mark.budget(90, "the page's snippet plans a 1B transformer for 8 and 64 devices from a cold cache, so a "
                        "second process calibrates 64 devices")
def test_plan_snippet_plans_a_1b_transformer_for_8_and_64_devices_without_allocating_it(tmp_path):
    (snippet,) = blocks("python plan")
    script = tmp_path / "plan.py"
    script.write_text(snippet)
    # Run through a parent that reports the peak memory of the snippet's process tree alone.
    parent = ("import resource, subprocess, sys; subprocess.run([sys.executable, sys.argv[1]], check=True); "
              "print('peak KiB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    # A fresh machine: no device speeds cached, so the 64 devices are calibrated in the child too.
    proc = subprocess.run([sys.executable, "-c", parent, str(script)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=clean_env(8, PARALLAX_CACHE_DIR=str(tmp_path / "cache")))
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = {(line.split()[0], line.split()[1]): line.split() for line in proc.stdout.splitlines()[1:]
            if line[:1].isdigit()}
    assert len(rows) == 6, proc.stdout
    for devices in ("8", "64"):
        dp, fsdp = rows[(devices, f"DataParallel(data={devices})")], rows[(devices, f"FSDP(fsdp={devices})")]
        assert dp[3:5] == ["4.0", "GiB"] and dp[-2:] == ["no", "yes"]  # 4 GiB of params on every device: not in 16 GB
        assert fsdp[-2:] == ["yes", "yes"]
    # Neither the snippet's process nor the 64-device one it starts held the 4 GiB of params (or anything near
    # it), nor did measuring the 64 devices' speeds.
    peak = int(re.search(r"^peak KiB (\d+)$", proc.stdout, re.M).group(1))
    assert peak < 3 * 2**20, peak


def test_the_site_builds_without_a_warning(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-E", "-q", "-b", "html", DOCS,
                           str(tmp_path / "html")], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=clean_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    landing = (tmp_path / "html" / "index.html").read_text()
    assert "Getting started" in landing and "API reference" in landing
    api = (tmp_path / "html" / "reference" / "api.html").read_text()
    assert "assert_equivalent" in api and "make_train_step" in api  # generated from the docstrings
