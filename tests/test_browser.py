"""The dashboard and the chat box as users see them: one JupyterLab started on localhost for this module's tests,
Debian chromium driven by Playwright (Python), a short notebook that starts a real demo run (one CPU process: what
the dashboard shows does not depend on the number of ranks) and displays its session, and one that chats with the
model of the suite's `demo_run`.

Asserts that the progress bar advances while the run trains, that the loss image changes, that clicking Stop ends the
run `cancelled` (checked through `FineTuneSession.attach` and state.json) and turns the dashboard's output into the
run's static record, which the notebook keeps: saved, its kernel shut down and the page reloaded, it shows the record
with its plot and no widget error. The run's report.html opens in Chromium offline. Screenshots go to
artifacts/ at the repository root (git-ignored). JupyterLab (its whole process group, kernels included) and
the run's processes are always torn down. Skips, saying why, only when chromium or Playwright is missing."""
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

from ilab_nb.runstore import new_run_id
from ilab_nb.session import FineTuneSession
from conftest import kill_processes_under, runs_env

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "artifacts"
STEP_RE = re.compile(r"step (\d+)")

pytestmark = [pytest.mark.timeout(480), pytest.mark.processes]

CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]


def chromium_path():
    "The Debian chromium binary, or None."
    for p in ("/usr/bin/chromium", shutil.which("chromium") or "", shutil.which("chromium-browser") or ""):
        if p and os.access(p, os.X_OK):
            return p
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lab:
    def __init__(self, url, token, proc, log_path):
        self.url, self.token, self.proc, self.log_path = url, token, proc, log_path

    def notebook_url(self, name):
        return f"{self.url}/lab/tree/{name}?token={self.token}&reset"

    def log(self):
        return Path(self.log_path).read_text(errors="replace")


@contextlib.contextmanager
def jupyter_lab(notebook_dir: Path, work_dir: Path, env: dict | None = None, timeout: float = 90):
    "JupyterLab serving `notebook_dir` on 127.0.0.1; yields a `Lab`; kills its process group on exit."
    port, token = free_port(), secrets.token_hex(16)
    home = work_dir / "jupyter-home"
    settings = home / "lab-settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True, exist_ok=True)
    # no news / update notification toasts over the notebook
    (settings / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    e = {**os.environ, **(env or {}),
         "JUPYTER_CONFIG_DIR": str(home / "config"), "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
         "JUPYTERLAB_SETTINGS_DIR": str(home / "lab-settings"), "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces"),
         "IPYTHONDIR": str(home / "ipython"), "JUPYTER_PLATFORM_DIRS": "1"}
    log_path = work_dir / "jupyterlab.log"
    cmd = [sys.executable, "-m", "jupyterlab", "--allow-root", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
           f"--ServerApp.token={token}", f"--ServerApp.root_dir={notebook_dir}", "--ServerApp.open_browser=False",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=e, cwd=notebook_dir, start_new_session=True)
    lab = Lab(f"http://127.0.0.1:{port}", token, proc, log_path)
    try:
        end = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with code {proc.returncode} before serving; its log:\n{lab.log()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{lab.url}/api/status?token={token}", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > end:
                raise RuntimeError(f"JupyterLab did not answer on port {port} within {timeout} s; its log:\n{lab.log()[-3000:]}")
            time.sleep(0.5)
        yield lab
    finally:
        stop_process_group(proc)


def stop_process_group(proc, grace: float = 10):
    "SIGTERM the process group of `proc` (JupyterLab and its kernels), then SIGKILL what is left."
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


@contextlib.contextmanager
def chromium_page(width: int = 1280, height: int = 1000):
    "A Playwright page in Debian chromium (headless)."
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_FLAGS, headless=True)
        try:
            ctx = browser.new_context(viewport={"width": width, "height": height}, device_scale_factor=1)
            yield ctx.new_page()
        finally:
            browser.close()


def run_all_cells(page, timeout_ms: int = 90_000):
    "Wait for the notebook and an idle kernel (accepting a kernel dialog), then Run > Run All Cells."
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=timeout_ms)
    end = time.monotonic() + timeout_ms / 1000
    while time.monotonic() < end:
        dialog = page.query_selector(".jp-Dialog .jp-mod-accept")
        if dialog is not None:
            dialog.click()
        text = page.inner_text(".jp-StatusBar-Widget") if page.query_selector(".jp-StatusBar-Widget") else ""
        if "Idle" in text and dialog is None:
            break
        time.sleep(0.5)
    else:
        raise TimeoutError("the notebook's kernel did not become idle in JupyterLab")
    page.click(".lm-MenuBar-item:has-text('Run')")
    page.click("li.lm-Menu-item[data-command='runmenu:run-all']")


def progress_state(page) -> dict:
    "What the dashboard shows now: step (from the text), bar width (%), status badge, plot image URL."
    return page.evaluate("""() => {
        const q = s => document.querySelector(s);
        const text = q('.ilab-progress-text') ? q('.ilab-progress-text').innerText : '';
        const bar = q('.ilab-progress .progress-bar');
        const img = q('.ilab-plot');
        return {text, width: bar ? parseFloat(bar.style.width || '0') : -1,
                status: q('.ilab-status') ? q('.ilab-status').innerText.trim().toLowerCase() : '',
                img: img ? img.getAttribute('src') : null};
    }""")


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def record_state(page) -> dict:
    "What a run's static record on the page shows: its badge, whether its plot image decoded, widget errors, widgets."
    return page.evaluate("""() => {
        const r = document.querySelector('.ilab-record');
        const img = r ? r.querySelector('img') : null;
        const all = document.body.innerText;
        return {badge: r ? r.querySelector('span').innerText.trim().toLowerCase() : '', text: r ? r.innerText : '',
                img: img && img.complete ? img.naturalWidth : 0,
                errors: /Error displaying widget|model not found/i.test(all),
                widgets: document.querySelectorAll('.ilab-dashboard').length};
    }""")


def settled_record(page, timeout_ms=60_000) -> dict:
    "`record_state` once the record is on the page and its plot has decoded (after 10 s more, as it is: the checks say what is missing)."
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    page.wait_for_selector(".ilab-record", timeout=timeout_ms)
    with contextlib.suppress(PlaywrightTimeout):
        page.wait_for_function("() => { const i = document.querySelector('.ilab-record img');"
                               " return !!i && i.complete && i.naturalWidth > 0; }", timeout=10_000)
    return record_state(page)


def record_shot(page, path):
    """The record as the page shows it now: the page clipped to the record's box. A display update may render the record
    anew at any time with the same content (JupyterLab re-renders an output per update), and an element screenshot of
    the replaced node fails as detached; the box of the one shown is enough for a clip (the whole page if none is)."""
    from playwright.sync_api import Error as PlaywrightError
    try: box = page.locator(".ilab-record").first.bounding_box()
    except PlaywrightError: box = None
    page.screenshot(path=str(path), **({"clip": box} if box else {}))


def shut_down_kernels(lab):
    "Shut down every kernel of this JupyterLab through its REST API, as the Kernel menu's Shut Down does."
    with urllib.request.urlopen(f"{lab.url}/api/kernels?token={lab.token}", timeout=10) as r: kernels = json.load(r)
    for k in kernels:
        req = urllib.request.Request(f"{lab.url}/api/kernels/{k['id']}?token={lab.token}", method="DELETE")
        urllib.request.urlopen(req, timeout=30).close()


def step_of(state) -> int:
    m = STEP_RE.search(state["text"])
    return int(m.group(1)) if m else -1


def poll(page, pred, timeout, what):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        st = progress_state(page)
        if pred(st):
            return st
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}; the dashboard shows {progress_state(page)}")


NOTEBOOK = """\
from ilab_nb import FineTuneSession
s = FineTuneSession(model={model!r}, data={data!r}, run_id={run_id!r}, num_processes=1, device="cpu",
                    max_seq_len=256, max_tokens_per_batch=1024, logging_steps=1, learning_rate=3e-3, max_steps=400)
s.start()
s.run_id, s.status
"""


def browser_missing() -> str | None:
    "Why the browser tests cannot run here (None when they can)."
    if chromium_path() is None:
        return ("Debian chromium is not installed (no /usr/bin/chromium): `make browser-deps` installs it with "
                "apt-get as root; without it the browser tests cannot run.")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError as e:
        return f"Playwright for Python is not importable ({e}): `pip install playwright` (dev requirement)."
    return None


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """One JupyterLab for this module's tests, serving `lab.dir`; its kernels import this checkout and keep their runs
    under `lab.runs` (with their own device locks), whose processes are killed afterwards."""
    why = browser_missing()
    if why: pytest.skip(why)
    work = tmp_path_factory.mktemp("lab")
    nbdir = work / "notebooks"; nbdir.mkdir()
    ARTIFACTS.mkdir(exist_ok=True)
    env = {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **runs_env(work)}
    try:
        with jupyter_lab(nbdir, work, env=env) as lab:
            lab.dir, lab.runs = nbdir, work / "runs"
            yield lab
    finally:
        kill_processes_under(work / "runs")


def test_dashboard_in_jupyterlab_with_chromium(demo, small_train, lab):
    run_id = new_run_id("browser")
    nbdir = lab.dir
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell(NOTEBOOK.format(model=str(demo.model_dir), data=str(small_train), run_id=run_id)),
        nbformat.v4.new_code_cell("s")])
    nb.metadata = {"kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}}
    nbformat.write(nb, nbdir / "dashboard.ipynb")
    t0 = time.monotonic()
    shots = []

    def shot(page, name):
        path = ARTIFACTS / f"browser-{name}.png"
        page.locator(".ilab-dashboard").first.screenshot(path=str(path))
        page.screenshot(path=str(ARTIFACTS / f"browser-{name}-page.png"))
        shots.append(path.name)

    try:
        with chromium_page() as page:
            page.goto(lab.notebook_url("dashboard.ipynb"))
            try:
                run_all_cells(page)
                page.wait_for_selector(".ilab-dashboard", timeout=120_000)
                # the run starts (processes, model, data): allow a loaded 2-core machine its time
                first = poll(page, lambda st: step_of(st) >= 1, 180, "the first training step in the dashboard")
                shot(page, "1-training")
                later = poll(page, lambda st: step_of(st) >= step_of(first) + 3 and st["img"] != first["img"], 90,
                             "the progress bar and the loss image to move on")
                shot(page, "2-later")
                assert later["width"] > first["width"] > 0, (first, later)
                assert later["status"] == "running", later
                page.click("text=Log — last")  # open the collapsed log lines
                page.wait_for_selector(".ilab-log pre", state="visible", timeout=10_000)
                shot(page, "3-log-open")
                page.click(".ilab-stop")
                # the run ends cancelled, and the cell's output becomes the run's record: static HTML, no widget
                rec = settled_record(page, timeout_ms=120_000)
                record_shot(page, ARTIFACTS / "browser-4-record.png")
                assert rec["badge"] == "cancelled" and rec["img"] > 0 and not rec["widgets"], rec
                assert step_of(dict(text=rec["text"])) >= step_of(later), rec
                # saved, its kernel shut down, the page reloaded: the record is what the notebook shows
                page.keyboard.press("Control+s")
                nb_file = nbdir / "dashboard.ipynb"
                end = time.monotonic() + 30
                while "ilab-record" not in nb_file.read_text() and time.monotonic() < end: time.sleep(0.5)
                assert "ilab-record" in nb_file.read_text() and WIDGET_VIEW not in nb_file.read_text()
                shut_down_kernels(lab)
                page.reload()
                again = settled_record(page)
                page.screenshot(path=str(ARTIFACTS / "browser-5-reopened-page.png"))
                shots.append("browser-5-reopened-page.png")
                assert again["badge"] == "cancelled" and again["img"] > 0 and not again["errors"] and not again["widgets"], again
            except Exception:
                with contextlib.suppress(Exception):
                    page.screenshot(path=str(ARTIFACTS / "browser-failure-page.png"))
                print("JupyterLab log (tail):\n" + lab.log()[-4000:])
                raise
        s = FineTuneSession.attach(run_id, runs_root=lab.runs)
        assert s.status == "cancelled", (s.status, s.reason, s.logs(20))
        assert json.loads((s.run_dir / "state.json").read_text())["status"] == "cancelled"
        assert (s.run_dir / "control" / "stop").exists()  # it was the dashboard's Stop, not a crash
        # its report.html, written by its supervisor as it ended, opens in a browser with no network
        with chromium_page() as page:
            page.context.set_offline(True)
            page.goto((s.run_dir / "report.html").as_uri())
            rep = settled_record(page)
            page.screenshot(path=str(ARTIFACTS / "browser-6-report.png"), full_page=True)
            assert rep["badge"] == "cancelled" and rep["img"] > 0, rep
        print(f"\n[measured] browser test {time.monotonic() - t0:.1f} s; screenshots: {shots}")
    finally:
        with contextlib.suppress(FileNotFoundError):
            s = FineTuneSession.attach(run_id, runs_root=lab.runs)
            if s.status not in ("completed", "failed", "cancelled"):
                s.stop(wait=True, timeout=60)


CHAT_NOTEBOOK = """\
import threading, ipywidgets as W
from transformers import AutoModelForCausalLM, AutoTokenizer
from ilab_nb.chat import ChatBox
def box(path, **kw): return ChatBox(AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path), **kw)
def paced(b, hold_at=300):
    # the untrained model's answer streams a token each 0.1 s and is held at its 300th until Stop is pressed: it is
    # still streaming when the test presses Stop, however fast this machine generates
    real, n = b.chat.model.forward, [0]
    def forward(*a, **k):
        n[0] += 1
        if n[0] > 1: threading.Event().wait(0.1)
        if n[0] > hold_at: b.chat.stop_event.wait(300)
        return real(*a, **k)
    b.chat.model.forward = forward
    return b
W.VBox([box({trained!r}, title="after the demo's run", system={system!r}, max_new_tokens=16),
        paced(box({untrained!r}, title="the untrained demo model", max_new_tokens=400))])
"""


def chat_state(page, box) -> dict:
    "The last answer and the status of chat box number `box` on the page."
    return page.evaluate("""(i) => {
        const b = document.querySelectorAll('.ilab-chat')[i];
        if (!b) return {answer: '', n: 0, status: ''};
        const a = b.querySelectorAll('.ilab-chat-assistant'), st = b.querySelector('.ilab-chat-status');
        return {answer: a.length ? a[a.length - 1].innerText : '', n: a.length, status: st ? st.innerText : ''};
    }""", box)


def held_out_question_it_knows(model_dir, eval_file):
    "A held-out demo question (system message and question, no earlier turns) that the trained model answers right."
    from ilab_nb.demo import answer_prompts, evaluate_answers, read_chat_jsonl
    ev = evaluate_answers(str(model_dir), eval_file=eval_file, limit=10)      # ten conversations: ten such questions
    right = {(e["conversation"], e["turn"]) for e in ev["examples"] if e["correct"]}
    items = [it for it in answer_prompts(read_chat_jsonl(eval_file)[:10])
             if len(it["context"]) == 2 and it["context"][0]["role"] == "system" and (it["conversation"], it["turn"]) in right]
    assert items, f"the demo's run answers none of the held-out one-question prompts right ({ev['accuracy']:.0%} overall)"
    return items[0]


def test_chat_box_in_jupyterlab_with_chromium(demo, lab, demo_run):
    """After the demo's run, its model answers a held-out question right in the chat box; the untrained model's long
    answer streams in piece by piece and stops when Stop is pressed."""
    trained = demo_run[1] / "final"
    item = held_out_question_it_knows(trained, demo.eval_file)
    nbdir = lab.dir
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(CHAT_NOTEBOOK.format(
        trained=str(trained), system=item["context"][0]["content"], untrained=str(demo.model_dir)))])
    nb.metadata = {"kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}}
    nbformat.write(nb, nbdir / "chat.ipynb")

    def until(box, pred, timeout, what):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            st = chat_state(page, box)
            if pred(st): return st
            time.sleep(0.1)
        raise AssertionError(f"timed out after {timeout} s waiting for {what}; chat box {box} shows {chat_state(page, box)}")

    def ask(box, text):
        field = page.locator(".ilab-chat-input input").nth(box)
        field.fill(text); field.press("Enter")

    with chromium_page() as page:
        page.goto(lab.notebook_url("chat.ipynb"))
        try:
            run_all_cells(page)
            page.wait_for_selector(".ilab-chat-input input", timeout=120_000)
            # the trained model, a question it never saw in training
            ask(0, item["question"])
            done = until(0, lambda st: "done" in st["status"], 120, "the trained model's answer")
            assert done["answer"].strip() == item["expected"], (item, done)
            page.locator(".ilab-chat").first.screenshot(path=str(ARTIFACTS / "browser-chat-trained.png"))
            # the untrained model rambles: its answer streams in, and Stop ends it
            ask(1, "Tell me everything.")
            first = until(1, lambda st: len(st["answer"].strip("▌ ")) > 0, 120, "the first streamed piece")
            later = until(1, lambda st: len(st["answer"]) > len(first["answer"]) + 5, 120, "more streamed text")
            assert later["answer"].startswith(first["answer"].rstrip("▌ ").rstrip()[:10])
            page.locator(".ilab-chat").nth(1).screenshot(path=str(ARTIFACTS / "browser-chat-streaming.png"))
            page.locator(".ilab-chat-stop").nth(1).click()
            stopped = until(1, lambda st: "stopped" in st["status"], 120, "the answer to stop")
            assert "▌" not in stopped["answer"] and stopped["n"] == 1
            page.locator(".ilab-chat").nth(1).screenshot(path=str(ARTIFACTS / "browser-chat-stopped.png"))
        except Exception:
            with contextlib.suppress(Exception):
                page.screenshot(path=str(ARTIFACTS / "browser-chat-failure-page.png"))
            print("JupyterLab log (tail):\n" + lab.log()[-4000:])
            raise
