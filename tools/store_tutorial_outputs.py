"""Run the tutorial headless, at its own size, and store its outputs in nbs/01_tutorial.ipynb (dev only).

    .venv/bin/python tools/store_tutorial_outputs.py          # a few minutes on 2 CPU cores

The tutorial's outputs are its documentation: a reader on GitHub sees the dashboards' records, the comparison, the
answers and the sweep's table without running anything. This executes every cell with nbclient (as
tests/test_notebooks_headless.py does, but with the tutorial's own numbers: no ILAB_NB_TUTORIAL_* variables), in a
runs root of its own under a temporary folder, and writes the notebook back with its outputs and no widget state (every
view whose run ended is already its static record). The headless test checks that the stored outputs have the shape
a fresh run gives (`output_shape`), so they cannot silently go stale.
"""
import os
import sys
import tempfile
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
TUTORIAL = ROOT / "nbs" / "01_tutorial.ipynb"


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def transient(o):
    "A widget with nothing behind it once its kernel is gone: a progress bar of a one-off step (building the demo)."
    return WIDGET_VIEW in o.get("data", {}) and set(o["data"]) <= {WIDGET_VIEW, "text/plain"}


def output_shape(nb):
    """Per code cell, what its outputs are, without what varies by machine (numbers, times, paths, run ids): each
    rich output's type and MIME types, the record classes its HTML holds, and whether it printed to stdout."""
    shapes = []
    for c in nb.cells:
        if c.cell_type != "code": continue
        shape = set()
        for o in c.get("outputs", []):
            if transient(o): continue
            if o["output_type"] == "stream":
                if o.get("name") == "stdout": shape.add("stdout")
            elif o["output_type"] == "error": shape.add(f"error {o.get('ename')}")
            else:
                shape.add(f"{o['output_type']} {' '.join(sorted(o.get('data', {})))}")
                html = o.get("data", {}).get("text/html", "")
                html = html if isinstance(html, str) else "".join(html)
                for cls in ("ilab-record", "ilab-sweep-record", "ilab-chat-record"):
                    if f'class="{cls}"' in html or f"class='{cls}'" in html: shape.add(cls)
        shapes.append(sorted(shape))
    return shapes


def strip_for_storage(nb):
    """The executed notebook as stored: outputs kept but transient widgets; no widget state, execution metadata or
    counts (as `nbdev_clean` leaves it, so that cleaning changes nothing)."""
    for k in ("widgets", "language_info"): nb.metadata.pop(k, None)
    for c in nb.cells:
        c.metadata.pop("execution", None)
        if c.cell_type != "code": continue
        c.execution_count = None
        c.outputs = [o for o in c.outputs if not transient(o)]
        for o in c.outputs:
            if "execution_count" in o: o.execution_count = None
    return nb


def main():
    nb = nbformat.read(TUTORIAL, as_version=4)
    with tempfile.TemporaryDirectory(prefix="ilab-tutorial-") as tmp:
        env = {"ILAB_NB_RUNS": f"{tmp}/runs", "ILAB_NB_LOCKS": f"{tmp}/locks", "ILAB_NB_CPU_SLOTS": "2",
               "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        if any(k.startswith("ILAB_NB_TUTORIAL_") for k in os.environ):
            sys.exit("unset the ILAB_NB_TUTORIAL_* variables: the stored outputs are the tutorial's own size")
        os.environ.update(env)
        NotebookClient(nb, timeout=1200, kernel_name="python3",
                       resources={"metadata": {"path": str(ROOT / "nbs")}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o["output_type"] == "error"]
    if errors: sys.exit(f"the tutorial failed: {errors[0].get('ename')}: {errors[0].get('evalue')}")
    nbformat.validator.normalize(nb)
    nbformat.write(strip_for_storage(nb), TUTORIAL)
    print(f"{TUTORIAL.relative_to(ROOT)}: {sum(len(c.get('outputs', [])) for c in nb.cells if c.cell_type == 'code')} outputs stored")


if __name__ == "__main__":
    main()
