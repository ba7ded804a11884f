"""The tutorial (nbs/01_tutorial.ipynb) executed headless with nbclient, storing widget state, as a user's
kernel would run it: real runs, the live dashboards, stop, resume, compare, load_model, chat, a sweep. Its numbers of
steps and of processes (1 here, 2 for a reader) and its training data come from the environment (ILAB_NB_TUTORIAL_*):
this test proves that every cell runs and the widgets are live, not that the model learns (the suite's `demo_run`,
160 steps of the same config, proves that; tests/test_cli.py reads its figures).

The tutorial's stopped-and-resumed run is also the suite's proof of FineTuneSession.resume() and of a stopped run
resumed with a larger max_steps: a new attempt from the stop's checkpoint whose metrics continue the first attempt's
to the new total, over a schedule recomputed for it. Its sweep is the suite's real sweep: run here on one CPU slot,
so that its two runs go through the device queue one after the other.

nbdev_test skips the tutorial's training cells (`#| notest`); this test runs all of them. The executed
notebook is written to artifacts/01_tutorial.executed.ipynb (git-ignored) for inspection.

The tutorial is stored with the outputs of a run at its own size (tools/store_outputs.py): this run's outputs
must have the same shape, cell by cell (what kinds of output, which records; not the numbers, which vary by machine
and size), so the stored ones cannot silently go stale."""
import base64
import importlib.util
import os
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from ilab_nb.monitor import RunMonitor
from ilab_nb.runstore import RunStore, run_processes
from ilab_nb.sweep import Sweep
from conftest import wait_until

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("store_outputs", ROOT / "tools" / "store_outputs.py")
store_outputs = importlib.util.module_from_spec(_spec)     # output_shape: what a stored output must match
_spec.loader.exec_module(store_outputs)
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
# The tutorial's own numbers are 160 steps (resumed for 20 more), 20, 30 and 10; a short first run still leaves 12
# steps between its first checkpoint (where the tutorial stops it) and its end.
TUTORIAL = dict(max_steps=16, save_steps=4, more_steps=4, second_run_steps=4, sweep_steps=2,
                num_processes=1)   # every cell runs; the 2-process runs are the other tests'
TOTAL = TUTORIAL["max_steps"] + TUTORIAL["more_steps"]      # the first run, resumed with more steps
DATA_LINES = 600        # about 16 steps an epoch on one process of 2048 tokens (8 on the demo config's 2 x 2048)

pytestmark = [pytest.mark.timeout(900), pytest.mark.processes]


def widget_models(nb, name):
    "`(state, buffers)` of every stored widget model called `name`, buffers decoded by path."
    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    out = []
    for m in state.values():
        if m["model_name"] == name:
            bufs = {tuple(b["path"]): base64.b64decode(b["data"]) for b in m.get("buffers", [])}
            out.append((m["state"], bufs))
    return out


def test_tutorial_executes_headless_with_live_widgets(demo, runs_root, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    data = tmp_path / "train.jsonl"
    data.write_text("".join(demo.train_file.read_text().splitlines(keepends=True)[:DATA_LINES]))
    monkeypatch.setenv("ILAB_NB_TUTORIAL_DATA", str(data))
    for k, v in TUTORIAL.items(): monkeypatch.setenv(f"ILAB_NB_TUTORIAL_{k.upper()}", str(v))
    monkeypatch.setenv("ILAB_NB_CPU_SLOTS", "1")      # one CPU slot: the sweep's two one-process runs queue for it
    nb = nbformat.read(ROOT / "nbs" / "01_tutorial.ipynb", as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3", store_widget_state=True,
                            resources={"metadata": {"path": str(ROOT / "nbs")}})
    t0 = time.perf_counter()
    try:
        client.execute()
    finally:
        (ROOT / "artifacts").mkdir(exist_ok=True)
        nbformat.write(nb, ROOT / "artifacts" / "01_tutorial.executed.ipynb")
    print(f"\n[measured] tutorial executed in {time.perf_counter() - t0:.1f} s")

    # the outputs stored in the tutorial have the shape of this run's: rerun tools/store_outputs.py if not
    stored = nbformat.read(ROOT / "nbs" / "01_tutorial.ipynb", as_version=4)
    fresh_shape, stored_shape = store_outputs.output_shape(nb), store_outputs.output_shape(stored)
    stale = [(i, s, f) for i, (s, f) in enumerate(zip(stored_shape, fresh_shape)) if s != f]
    assert len(stored_shape) == len(fresh_shape) and not stale, \
        f"the tutorial's stored outputs are stale (code cell, stored, fresh): {stale[:3]}; run tools/store_outputs.py"

    # the dashboards' progress bars: the resumed run, the second run and the attached one end complete (value == max)
    steps = {TOTAL, TUTORIAL["second_run_steps"]}
    bars = [s for s, _ in widget_models(nb, "IntProgressModel") if "ilab-progress" in s.get("_dom_classes", [])]
    assert len(bars) >= 3, f"expected the tutorial's dashboards in the widget state, found {len(bars)} progress bars"
    done = [b for b in bars if b["bar_style"] == "success"]
    assert done and all(b["value"] == b["max"] and b["max"] in steps for b in done), bars
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
    assert "cancelled" in text and "completed" in text
    assert f"held-out exact-match accuracy after {TOTAL} steps:" in text

    # The saved notebook is the record of its runs: every view whose run ended (the dashboards, the sweep's, the chat
    # box after its snapshot) is static HTML with the loss plot inlined, and no widget view, which a kernel-less
    # renderer would show as nothing (or JupyterLab as an error).
    outs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if "data" in o]
    html_of = lambda cls: [o for o in outs if f"class=\"{cls}\"" in o["data"].get("text/html", "")
                           or f"class='{cls}'" in o["data"].get("text/html", "")]
    records, sweeps, chats = html_of("ilab-record"), html_of("ilab-sweep-record"), html_of("ilab-chat-record")
    assert len(records) >= 3 and len(sweeps) == 1 and len(chats) == 1, (len(records), len(sweeps), len(chats))
    assert not [o for o in records + sweeps + chats if WIDGET_VIEW in o["data"]]
    done = [o["data"]["text/html"] for o in records if ">completed</span>" in o["data"]["text/html"]]
    assert len(done) >= 3 and all("final training loss" in h and 'src="data:image/png;base64,' in h for h in done)
    assert 'src="data:image/png;base64,' in sweeps[0]["data"]["text/html"]
    assert not [o for o in outs if WIDGET_VIEW in o["data"]], "a live widget view was left in the saved notebook"
    # rendered without a kernel, as GitHub, nbviewer and documentation builds do
    from nbconvert import HTMLExporter
    page, _ = HTMLExporter().from_notebook_node(nbformat.reads(nbformat.writes(nb), as_version=4))
    assert page.count(">completed</span>") >= 3 and "ilab-sweep-record" in page and "ilab-chat-record" in page
    assert page.count("data:image/png;base64,") >= 4

    # FineTuneSession.resume(), on the tutorial's first run: stopped at a checkpoint, resumed as attempt 2 from it,
    # completed; the logged steps (every 2nd, logging_steps=2) continue without a gap or a repeat; nothing is left.
    store = RunStore(runs_root)
    (run_id,) = [r for r in store.list_runs() if r.endswith("-lr-3e-3")]
    run_dir = store.run_dir(run_id)
    st = store.read_state(run_id)
    assert st["status"] == "completed" and st["attempt"] == 2, st
    assert [e["event"] for e in store.events(run_id)].count("resumed") == 1
    m = RunMonitor(run_dir); m.poll()
    stopped = [r for r in m.records if r.get("kind") == "event" and r.get("event") == "stopped"]
    assert len(stopped) == 1 and stopped[0]["attempt"] == 1
    at = stopped[0]["step"]
    saved = [r["step"] for r in m.records if r.get("kind") == "event" and r.get("event") == "checkpoint" and r["attempt"] == 1]
    assert saved and saved[-1] == at                # the stop wrote a checkpoint at the step it stopped at
    headers = [r for r in m.records if r.get("kind") == "header"]
    assert [(h["attempt"], h["resumed_from_step"]) for h in headers] == [(1, None), (2, at)]
    # resumed with more steps than it started with: the new total, the change recorded, the schedule recomputed
    assert [h["total_steps"] for h in headers] == [TUTORIAL["max_steps"], TOTAL]
    assert headers[1]["changes"] == {"max_steps": [TUTORIAL["max_steps"], TOTAL]} and st["changes"] == {"2": headers[1]["changes"]}
    assert f"over {TOTAL} steps (was {TUTORIAL['max_steps']})" in headers[1]["schedule"]["note"], headers[1]["schedule"]
    train = m.train_records
    logged = [r["step"] for r in train]
    assert logged == sorted(set(logged)) and logged[-1] == TOTAL
    assert set(range(2, TOTAL + 1, 2)) <= set(logged)
    assert all((r["attempt"] == 1) == (r["step"] <= at) for r in train), [(r["step"], r["attempt"]) for r in train]
    wait_until(lambda: not run_processes(run_dir), 30, what=f"every process of {run_id} to end")

    # The sweep, the suite's real one: its two runs went through the device queue (one slot: the second started once
    # the first had ended), completed with a full table, and this process (not the kernel that made it) finds the
    # sweep and reads the table the kernel showed; the sweep's folder is no run.
    (sweep_id,) = Sweep.list_sweeps(runs_root)
    sw = Sweep.attach(sweep_id, runs_root)
    assert sw.axes == {"learning_rate": [1e-3, 3e-3]} and len(sw.sessions) == 2
    df = sw.results()
    assert df.learning_rate.tolist() == [1e-3, 3e-3] and (df.status == "completed").all(), df
    assert (df.step == TUTORIAL["sweep_steps"]).all() and df.final_loss.notna().all() and df.best_eval_loss.notna().all()
    assert (df.tokens_per_s > 0).all()
    (a0, e0), (a1, e1) = sorted((s.state["starting_at"], s.state["ended_at"]) for s in sw.sessions)
    assert e0 <= a1, "the sweep's runs held the one CPU slot at the same time"
    shown = "".join(o.get("data", {}).get("text/plain", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert all(r in shown for r in sw.run_ids) and set(sw.run_ids) <= set(store.list_runs()) and sweep_id not in store.list_runs()
    # each run's supervisor wrote its report.html as the run ended; the last of the sweep's, the sweep's report
    for s in [store.run_dir(r) for r in store.list_runs()]:
        assert (s / "report.html").exists() and (s / "loss.png").exists(), s
    wait_until(lambda: (sw.dir / "sweep-report.html").exists(), 30, what="the sweep's report")
    assert "ilab-sweep-record" in (sw.dir / "sweep-report.html").read_text()


@pytest.mark.parametrize("name", [n for n in store_outputs.STORED if n != "01_tutorial"])   # the tutorial: above
def test_stored_example_outputs_are_current(name, tmp_path):
    "A notebook kept with its key examples' outputs (a record): a fresh headless run gives outputs of the same shape."
    stored = nbformat.read(ROOT / "nbs" / f"{name}.ipynb", as_version=4)
    assert any(c.get("outputs") for c in stored.cells if c.cell_type == "code"), f"{name} was saved without its outputs"
    fresh = store_outputs.execute(nbformat.read(ROOT / "nbs" / f"{name}.ipynb", as_version=4), tmp_path, timeout=300)
    assert store_outputs.output_shape(fresh) == store_outputs.output_shape(stored), \
        f"{name}'s stored outputs are stale: run tools/store_outputs.py {name}"
