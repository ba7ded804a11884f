"""The tutorial (nbs/12_tutorial.ipynb) executed headless with nbclient, storing widget state, as a user's
kernel would run it: real runs (2 CPU processes each), the live dashboards, stop, resume, compare, load_model.

nbdev_test skips the tutorial's training cells (`#| notest`); this test runs all of them. The executed
notebook is written to artifacts/12_tutorial.executed.ipynb (git-ignored) for inspection."""
import base64
import re
import os
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
STEPS = {160, 30}  # max_steps of the tutorial's two runs

pytestmark = pytest.mark.timeout(900)


def widget_models(nb, name):
    "`(state, buffers)` of every stored widget model called `name`, buffers decoded by path."
    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    out = []
    for m in state.values():
        if m["model_name"] == name:
            bufs = {tuple(b["path"]): base64.b64decode(b["data"]) for b in m.get("buffers", [])}
            out.append((m["state"], bufs))
    return out


def test_tutorial_executes_headless_with_live_widgets(runs_root, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    nb = nbformat.read(ROOT / "nbs" / "12_tutorial.ipynb", as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3", store_widget_state=True,
                            resources={"metadata": {"path": str(ROOT / "nbs")}})
    t0 = time.perf_counter()
    try:
        client.execute()
    finally:
        (ROOT / "artifacts").mkdir(exist_ok=True)
        nbformat.write(nb, ROOT / "artifacts" / "12_tutorial.executed.ipynb")
    print(f"\n[measured] tutorial executed in {time.perf_counter() - t0:.1f} s")

    # the dashboards' progress bars: the resumed run, the second run and the attached one end complete (value == max)
    bars = [s for s, _ in widget_models(nb, "IntProgressModel") if "ilab-progress" in s.get("_dom_classes", [])]
    assert len(bars) >= 3, f"expected the tutorial's dashboards in the widget state, found {len(bars)} progress bars"
    done = [b for b in bars if b["bar_style"] == "success"]
    assert done and all(b["value"] == b["max"] and b["max"] in STEPS for b in done), bars
    # (the first dashboard of the stopped run either ended "cancelled" or, when resume() came before its next
    # refresh, followed the resumed attempt to the end: both are right)
    # the loss plots are PNGs in the Image widgets
    plots = [bufs.get(("value",), b"") for s, bufs in widget_models(nb, "ImageModel") if "ilab-plot" in s.get("_dom_classes", [])]
    assert plots and all(p[:8] == b"\x89PNG\r\n\x1a\n" for p in plots)
    assert len(set(plots)) >= 2, "the dashboards of the two runs (different learning rates) drew the same picture"
    # compare() left a static PNG in the notebook (no widget state needed to see it)
    pngs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
            if "image/png" in o.get("data", {})]
    assert pngs, "the compare() cell has no image/png output"
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "cancelled" in text and "completed" in text and "held-out exact-match accuracy" in text
    # the stopped-and-resumed run learned: its held-out exact-match accuracy (0 % before fine-tuning) is high
    acc = re.search(r"held-out exact-match accuracy after (\d+) steps: (\d+)%", text)
    assert acc and int(acc.group(1)) == 160 and int(acc.group(2)) >= 80, acc and acc.group(0)
