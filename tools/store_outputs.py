"""Run notebooks headless and store their outputs in them (dev only): the tutorial, and the key examples of others.

    .venv/bin/python tools/store_outputs.py                  # every notebook in STORED (the tutorial: a few minutes)
    .venv/bin/python tools/store_outputs.py 41_record        # one of them

Outputs are documentation: a reader on GitHub sees the dashboards' records, the comparison, the answers and the
sweep's table without running anything. This executes every cell with nbclient (the tutorial as
tests/test_notebooks_headless.py does, but with its own numbers: no ILAB_NB_TUTORIAL_* variables), in a runs root of
its own under a temporary folder, and writes the notebook back with its outputs, in the form `nbdev_clean` leaves (no
widget state, no execution counts; every view whose run ended is already its static record). The headless tests
check that a fresh run's outputs have the stored ones' shape (`output_shape`), so they cannot silently go stale.
"""
import os
import sys
import tempfile
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
STORED = ["01_tutorial", "41_record"]       # the notebooks kept with their outputs


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


def execute(nb, runs_root, timeout=1200):
    "Run every cell of `nb` in a fresh kernel from nbs/, its runs under `runs_root`; returns `nb`, its outputs filled."
    env = {"ILAB_NB_RUNS": f"{runs_root}/runs", "ILAB_NB_LOCKS": f"{runs_root}/locks", "ILAB_NB_CPU_SLOTS": "2",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(ROOT / "nbs")}}).execute()
    finally:
        for k, v in saved.items():
            if v is None: os.environ.pop(k, None)
            else: os.environ[k] = v
    return nb


def store(name):
    "Execute nbs/`name`.ipynb and store it with its outputs."
    path = ROOT / "nbs" / f"{name}.ipynb"
    nb = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory(prefix="ilab-outputs-") as tmp: execute(nb, tmp)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o["output_type"] == "error"]
    if errors: sys.exit(f"{path.name} failed: {errors[0].get('ename')}: {errors[0].get('evalue')}")
    nbformat.validator.normalize(nb)
    nbformat.write(strip_for_storage(nb), path)
    print(f"{path.relative_to(ROOT)}: {sum(len(c.get('outputs', [])) for c in nb.cells if c.cell_type == 'code')} outputs stored")


def main(names):
    if any(k.startswith("ILAB_NB_TUTORIAL_") for k in os.environ):
        sys.exit("unset the ILAB_NB_TUTORIAL_* variables: the stored outputs are the tutorial's own size")
    unknown = set(names) - set(STORED)
    if unknown: sys.exit(f"not kept with outputs: {sorted(unknown)}; STORED names {STORED}")
    for name in names or STORED: store(name)


if __name__ == "__main__":
    main(sys.argv[1:])
