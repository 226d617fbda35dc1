"""Regenerates the pictures the docs show, from the docs' own code: ``python docs/make_images.py``.

- ``images/summary.png``: ``px.summarize(...).figure()`` for the digits MLP of Getting started,
  under ``DataParallel(2) × FSDP(4)`` with the optimizer state offloaded.
- ``images/plan.png``: ``px.plan(...).figure()`` for the 1.07B-parameter transformer planned in
  "Know before you run" (its code is read from that page and run as written).
- ``images/landing.png``: a screenshot of the built site's landing page (``make docs`` first;
  needs ``chromium``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(HERE))


def summary_figure() -> None:
    import optax
    from sklearn.datasets import load_digits

    import parallax as px

    with open(os.path.join(HERE, "getting-started.md")) as f:
        page = f.read()
    namespace: dict = {}
    exec(re.findall(r"```python\n(.*?)```", page, re.S)[0].split("trainer = px.Trainer")[0], namespace)
    digits = load_digits()
    batch = {"x": (digits.data[:64] / 16).astype("float32"), "y": digits.target[:64].astype("int32")}
    strategy = px.combine(px.DataParallel(2), px.FSDP(4, min_weight_size=2**10))
    state = px.init_state(namespace["MLP"](), optax.adam(1e-3), batch, strategy=strategy, loss_fn=namespace["loss_fn"],
                          options=px.StepOptions(offload="optimizer"))
    px.summarize(state).figure(os.path.join(HERE, "images", "summary.png"), budget="64KB")


def plan_figure() -> None:
    with open(os.path.join(HERE, "guides", "know-before-you-run.md")) as f:
        page = f.read()
    (snippet,) = re.findall(r"```python plan\n(.*?)```", page, re.S)
    namespace: dict = {}
    exec(snippet.replace("report.figure()", f"report.figure({os.path.join(HERE, 'images', 'plan.png')!r})"), namespace)


def landing_screenshot() -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    index = os.path.join(HERE, "_build", "html", "index.html")
    if browser is None or not os.path.exists(index):
        print("landing.png: needs chromium and a built site (make docs)")
        return
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--window-size=1280,1000", f"--screenshot={os.path.join(HERE, 'images', 'landing.png')}",
                    f"file://{index}"], check=True, capture_output=True)


if __name__ == "__main__":
    summary_figure()
    plan_figure()
    landing_screenshot()
