"""Trait-level tests of ilab_nb.dashboard: known records go into a run directory (the files of the contract),
the real RunMonitor reads them, and the widgets' traits are checked. No front end, no training."""
import gc
import json
import math
import threading
import time
from pathlib import Path

import psutil
import pytest

from ilab_nb.compare import LossComparison, compare
from ilab_nb.dashboard import Dashboard, render_text, run_curves
from ilab_nb.monitor import RunMonitor

ROOT = Path(__file__).resolve().parents[1]


class RunFiles:
    "Writes a run directory the way the worker and runstore do (metrics.jsonl lines, state.json, logs, checkpoints)."

    def __init__(self, root: Path, run_id: str = "run-test", total: int = 40):
        self.dir = root / run_id
        (self.dir / "logs").mkdir(parents=True)
        self.total, self.attempt = total, 1

    def records(self, *recs):
        with open(self.dir / "metrics.jsonl", "a") as f:
            for r in recs:
                f.write(json.dumps({"schema": 1, "run_id": self.dir.name, "attempt": self.attempt, "time": time.time(), **r}) + "\n")

    def header(self, resumed_from_step=None, **kw):
        self.records({"kind": "header", "world_size": 2, "backend": "gloo", "strategy": "ddp", "device": "cpu",
                      "precision": "fp32", "layout": "bucketed", "total_steps": self.total, "num_train_samples": 80,
                      "num_eval_samples": 8, "resumed_from_step": resumed_from_step, "params_total": 4_100_000, **kw})

    def train(self, *steps, loss=lambda s: 4 * 0.97**s):
        self.records(*({"kind": "train", "step": s, "total_steps": self.total, "epoch": s / 20, "loss": loss(s),
                        "learning_rate": 1e-3, "grad_norm": 1.0, "tokens": 400, "tokens_per_s": 2000.0 + s,
                        "efficiency": 0.97, "elapsed_s": 0.5 * s, "peak_mem_mb": 90.0} for s in steps))

    def state(self, state, **kw):
        tmp = self.dir / "state.json.tmp"
        tmp.write_text(json.dumps({"run_id": self.dir.name, "status": state, "attempt": self.attempt, **kw}))
        tmp.replace(self.dir / "state.json")

    def log(self, *lines, rank=0):
        with open(self.dir / "logs" / f"rank-{rank}.log", "a") as f:
            f.write("".join(l + "\n" for l in lines))

    def checkpoint(self, step, loss, eval_loss=None):
        d = self.dir / "checkpoints" / f"step-{step:08d}"
        d.mkdir(parents=True)
        (d / "trainer_state.json").write_text(json.dumps({"step": step, "epoch": step / 20, "total_steps": self.total,
                                                          "last_metrics": {"loss": loss}, "eval_loss": eval_loss}))
        (d / "COMPLETE").write_text("")
        self.records({"kind": "event", "event": "checkpoint", "step": step, "path": str(d)})


@pytest.fixture
def run(tmp_path):
    r = RunFiles(tmp_path)
    r.state("running")
    r.header()
    return r


def wait_for(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_traits_after_known_records(run):
    run.train(*range(1, 11))
    run.log("loading model", "step 10 loss 2.95")
    d = Dashboard(RunMonitor(run.dir), on_stop=lambda: None, on_resume=lambda: None, autostart=False)
    assert not d.running
    assert (d.progress.value, d.progress.max, d.progress.bar_style) == (10, 40, "info")
    t = d.progress_text.value
    assert "step <b>10</b> / 40 (25 %)" in t and "epoch 0.50" in t and "elapsed 0:05" in t
    assert "ETA 0:15" in t and "2,010 tokens/s" in t and f"loss {4 * 0.97**10:.4f}" in t
    assert ">running<" in d.badge.value and "#1a73e8" in d.badge.value
    assert "run-test" in d.header.value and "2 × cpu (gloo, ddp)" in d.header.value and "4.1 M parameters" in d.header.value
    assert d.stop_button.layout.display == "" and d.resume_button.layout.display == "none"
    assert d.failure.layout.display == "none"
    assert d.image.value[:8] == b"\x89PNG\r\n\x1a\n"
    assert "step 10 loss 2.95" in d.log_view.value
    assert "no complete checkpoint" in d.checkpoint_view.value
    # nothing new: no widget changes and no redraw
    png, redraws = d.image.value, d.redraws
    assert d.update() is False and d.redraws == redraws and d.image.value is png
    # new records move the bar and redraw the plot; an eval point and a checkpoint show up
    run.train(*range(11, 21))
    run.records({"kind": "eval", "step": 20, "epoch": 1.0, "eval_loss": 2.2, "eval_tokens": 800})
    run.checkpoint(20, loss=1.9, eval_loss=2.2)
    assert d.update() is True
    assert d.progress.value == 20 and d.redraws == redraws + 1 and d.image.value != png
    assert d.details.get_title(1) == "Checkpoints (1)"
    assert "<td>20</td><td>1.00</td><td>1.9000</td><td>2.2000</td>" in d.checkpoint_view.value
    d.close()


def test_plot_axes_follow_the_data_after_an_empty_start(run):
    d = Dashboard(RunMonitor(run.dir), autostart=False)
    assert d.plot.waiting.get_visible() and d.image.value[:4] == b"\x89PNG"
    run.train(*range(1, 11))
    d.update()
    lo, hi = d.plot.ax.get_ylim()
    assert not d.plot.waiting.get_visible()
    assert lo <= 4 * 0.97**10 and hi >= 4 * 0.97 and hi < 5 and 10 <= d.plot.ax.get_xlim()[1] <= 20  # not the 40 planned
    lo, hi = d.plot.ax_lr.get_ylim()
    assert lo <= 1e-3 <= hi < 0.01
    d.plot.fig.canvas.draw()
    labels = [t.get_text() for t in d.plot.ax_lr.get_yticklabels() if t.get_text()]
    assert len(set(labels)) == len(labels) > 2, labels  # a flat learning rate still gets distinct tick labels
    d.close()


def test_completed_run_shows_whole_history_and_starts_no_thread(run):
    """An attached old run: the first refresh draws everything; the thread is not needed."""
    run.train(*range(1, 41))
    run.records({"kind": "event", "event": "completed", "step": 40})
    run.state("completed")
    d = Dashboard(RunMonitor(run.dir), on_stop=lambda: None, on_resume=lambda: None, autostart=True)
    assert not d.running
    assert (d.progress.value, d.progress.max, d.progress.bar_style) == (40, 40, "success")
    assert ">completed<" in d.badge.value and "ETA" not in d.progress_text.value
    assert d.stop_button.layout.display == "none" and d.resume_button.layout.display == "none"
    d.close()


def test_failed_run_shows_reason_and_failing_lines_and_resume(run):
    run.train(1, 2, 3)
    run.state("failed", reason="rank 1 exited with code 1: RuntimeError: shape mismatch", failed_rank=1,
              log_tail=["Traceback (most recent call last):", "RuntimeError: shape mismatch <x>"])
    run.log("rank one says goodbye", rank=1)
    d = Dashboard(RunMonitor(run.dir), on_stop=lambda: None, on_resume=lambda: None, autostart=False)
    assert ">failed<" in d.badge.value and d.progress.bar_style == "danger"
    assert d.failure.layout.display == ""
    assert "shape mismatch" in d.failure.value and "RuntimeError: shape mismatch &lt;x&gt;" in d.failure.value
    assert "rank one says goodbye" in d.log_view.value  # the failing rank's log
    assert d.stop_button.layout.display == "none" and d.resume_button.layout.display == ""
    assert "failed: rank 1 exited" in d.text()
    d.close()
    # without a resume callable there is no Resume button
    d2 = Dashboard(RunMonitor(run.dir), autostart=False)
    assert d2.resume_button.layout.display == "none"
    d2.close()


def test_resumed_attempt_replaces_replayed_steps(run):
    run.train(*range(1, 16))
    run.state("cancelled", reason="stopped on request.")
    d = Dashboard(RunMonitor(run.dir), on_resume=lambda: None, autostart=False)
    assert d.progress.value == 15 and d.progress.bar_style == "warning"
    assert d.failure.layout.display == "" and "Run stopped:</b> stopped on request. Resume continues" in d.failure.value
    run.attempt = 2
    run.state("running")
    run.header(resumed_from_step=10)
    run.train(11, 12, loss=lambda s: 0.5)
    d.update()
    assert d.progress.value == 12 and "attempt 2" in d.header.value and d.failure.layout.display == "none"
    c = run_curves(d.monitor.records)
    assert c["steps"] == list(range(1, 13)) and c["loss"][-2:] == [0.5, 0.5] and c["resumed_at"] == [10]
    d.close()


def test_status_fn_wins_and_its_failure_is_reported(run):
    run.train(1)
    d = Dashboard(RunMonitor(run.dir), status_fn=lambda: "cancelled", autostart=False)
    assert ">cancelled<" in d.badge.value  # state.json still says running
    d.close()

    def broken():
        raise RuntimeError("no supervisor")
    d = Dashboard(RunMonitor(run.dir), status_fn=broken, autostart=False)
    assert ">running<" in d.badge.value and "status_fn failed (RuntimeError: no supervisor)" in d.message.value
    d.close()


def test_two_dashboards_on_one_monitor_both_see_new_records(run):
    mon = RunMonitor(run.dir)
    a, b = Dashboard(mon, autostart=False), Dashboard(mon, autostart=False)
    run.train(1, 2, 3)
    a.update()  # a's poll consumes the new records from the monitor ...
    b.update()  # ... and b still sees them
    assert a.progress.value == b.progress.value == 3
    assert a.image.value == b.image.value
    a.close(), b.close()


def test_thread_follows_the_run_and_stops_when_terminal(run):
    d = Dashboard(RunMonitor(run.dir), refresh_s=0.05, autostart=True)
    assert d.running
    for s in range(1, 6):
        run.train(s)
        assert wait_for(lambda: d.progress.value == s), f"the thread did not show step {s}"
    # the last records are written just before the run turns terminal: the final refresh must show them
    run.train(6, 7, 8)
    run.records({"kind": "event", "event": "completed", "step": 8})
    run.state("completed")
    assert wait_for(lambda: not d.running, 5), "the refresh thread did not end after the run completed"
    assert d.progress.value == 8 and ">completed<" in d.badge.value
    n = d.refreshes
    time.sleep(0.3)
    assert d.refreshes == n
    d.close()


def test_thread_stops_on_close(run):
    threads_before = threading.active_count()
    ds = [Dashboard(RunMonitor(run.dir), refresh_s=0.05, autostart=True) for _ in range(3)]
    assert all(d.running for d in ds) and threading.active_count() == threads_before + 3
    run.train(1, 2)
    assert wait_for(lambda: all(d.progress.value == 2 for d in ds))
    for d in ds:
        d.close()
    assert not any(d.running for d in ds) and threading.active_count() == threads_before
    d = ds[0]
    n = d.refreshes
    run.train(3)
    time.sleep(0.3)
    assert d.refreshes == n
    d.start()  # a closed dashboard stays closed
    assert not d.running


def test_stop_and_resume_buttons_call_back_off_the_message_loop(run):
    run.train(1)
    calls, release = [], threading.Event()

    def on_stop():
        calls.append(("stop", threading.current_thread() is threading.main_thread()))
        release.wait(5)
        run.state("cancelled")

    def on_resume():
        calls.append(("resume", threading.current_thread() is threading.main_thread()))
        run.state("running")

    d = Dashboard(RunMonitor(run.dir), on_stop=on_stop, on_resume=on_resume, refresh_s=0.05, autostart=True)
    d.stop_button.click()
    assert d.stop_button.disabled and d.stop_button.description == "Stopping…"  # the click returned at once
    release.set()
    assert wait_for(lambda: not d.running and ">cancelled<" in d.badge.value)
    assert calls == [("stop", False)] and not d.stop_button.disabled
    assert d.stop_button.layout.display == "none" and d.resume_button.layout.display == ""
    d.resume_button.click()
    assert wait_for(lambda: d.running and ">running<" in d.badge.value), "Resume did not restart the live view"
    assert calls[-1] == ("resume", False)
    d.close()


def test_a_failing_callback_is_reported_in_the_widget(run):
    def on_stop():
        raise RuntimeError("supervisor not found")
    d = Dashboard(RunMonitor(run.dir), on_stop=on_stop, autostart=False)
    d.stop_button.click()
    assert wait_for(lambda: "stop failed: RuntimeError: supervisor not found" in d.message.value)
    assert wait_for(lambda: not d.stop_button.disabled and d.stop_button.description == "Stop")
    d.close()


def test_text_fallback(run):
    run.train(*range(1, 21))
    d = Dashboard(RunMonitor(run.dir), autostart=False)
    text = d.text()
    line1, line2 = text.splitlines()
    assert line1 == "run-test  running"
    assert "20/40" in line2 and "50%" in line2 and "loss=" in line2 and "tok/s" in line2
    assert repr(d) == text
    bundle = d._repr_mimebundle_()
    assert bundle["text/plain"] == text and "application/vnd.jupyter.widget-view+json" in bundle
    assert render_text(RunMonitor(run.dir), status="queued").startswith("run-test  queued")
    (run.dir / "metrics.jsonl").unlink()
    assert render_text(RunMonitor(run.dir), status="queued") == "run-test  queued\nno training step yet"
    d.close()


EPISODE = [  # a GRPO run with tools: a call that works, one that times out, then the answer
    {"role": "assistant", "content": "Let me check <the> weather.",
     "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo", "days": 2}}}]},
    {"role": "tool", "name": "weather", "content": "{'sky': '<script>alert(1)</script>', 'temp': 21}"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function", "function": {"name": "forecast", "arguments": {}}}]},
    {"role": "tool", "name": "forecast", "content": "{'error': 'timed out after 2 s'}"},
    {"role": "assistant", "content": "Sunny & 21 degrees in Oslo."}]


def test_a_run_with_tools_shows_its_episodes_and_tool_calls(run):
    """Issue 52: a GRPO run with tools, from its metrics.jsonl alone: the dashboard's completions show each episode
    turn by turn (the call and its arguments, its result, the failed call marked, the answer, the reward per function),
    its rewards panel the tool calls' frequencies; the record, report.html and record_text the same."""
    from ilab_nb.record import record_html, record_text, write_report
    for s in (1, 2):
        run.records({"kind": "train", "step": s, "total_steps": run.total, "epoch": s / 20, "loss": 0.1,
                     "learning_rate": 1e-3, "grad_norm": 1.0, "tokens": 400, "tokens_per_s": 2000.0,
                     "efficiency": 0.97, "elapsed_s": 0.5 * s, "peak_mem_mb": 90.0, "reward": 0.5,
                     "rewards/weather_used/mean": 1.0, "rewards/right/mean": 0.0,
                     "tools/call_frequency": 2.0, "tools/failure_frequency": 0.5})
    run.records({"kind": "completions", "step": 2, "completions": [
        {"prompt": "Weather in Oslo?", "completion": EPISODE[-1]["content"], "reward": 0.5, "advantage": 0.125,
         "rewards": {"weather_used": 1.0, "right": 0.0}, "episode": EPISODE}]})
    run.records({"kind": "eval", "step": 2, "epoch": 0.1, "eval_prompts": 2, "eval_reward": 0.25,
                 "eval_tools/call_frequency": 1.0, "eval_tools/failure_frequency": 0.0})
    d = Dashboard(RunMonitor(run.dir), autostart=False)
    shown = d.completions_view.value
    assert "Completions at step 2" in shown and ">episode</th>" in shown
    assert ">weather_used</th>" in shown and ">right</th>" in shown and ">0.125<" in shown   # reward per function
    turns = ["assistant:</span> Let me check &lt;the&gt; weather.",
             "→ weather(city=&#34;Oslo&#34;, days=2)",
             "← weather:</span> {&#39;sky&#39;: &#39;&lt;script&gt;alert(1)&lt;/script&gt;&#39;, &#39;temp&#39;: 21}",
             "→ forecast()",
             "✗ forecast failed:</span> timed out after 2 s",
             "answer:</span> Sunny &amp; 21 degrees in Oslo."]
    assert all(t in shown for t in turns), shown
    assert [shown.index(t) for t in turns] == sorted(shown.index(t) for t in turns)          # in the episode's order
    assert "<script>" not in shown and "no final answer" not in shown
    failed = shown[:shown.index("✗ forecast failed")].rsplit("<div", 1)[1]
    assert "#d93025" in failed and "#fce8e6" in failed                                     # the failure in red
    assert d.reward_view.value[:4] == b"\x89PNG"
    assert [a.get_title(loc="left") for a in d._reward_fig.axes] == ["Mean reward", "Tool calls"]
    assert {l.get_label() for l in d._reward_fig.axes[1].lines} == {
        "calls per rollout", "failed per call", "held-out calls per rollout", "held-out failed per call"}
    d.close()
    m = RunMonitor(run.dir)
    record = record_html(m)
    assert all(t in record for t in turns) and "<script>" not in record and record.count("data:image/png") == 2
    report = write_report(run.dir).read_text()
    assert all(t in report for t in turns) and "<script>" not in report
    text = record_text(m)
    assert "tool calls per rollout: 2.00 (step 2)" in text and "failed tool calls: 50% (step 2)" in text


def test_compare_two_runs(tmp_path):
    a, b = RunFiles(tmp_path, "lr-small"), RunFiles(tmp_path, "lr-large")
    for r, rate, n in ((a, 0.99, 30), (b, 0.9, 40)):
        r.header()
        r.train(*range(1, n + 1), loss=lambda s, rate=rate: 4 * rate**s)
    b.records({"kind": "eval", "step": 40, "epoch": 2.0, "eval_loss": 0.3, "eval_tokens": 100})
    cmp = compare([a.dir, RunMonitor(b.dir)], labels=["lr 1e-4", "lr 1e-3"])
    assert isinstance(cmp, LossComparison)
    assert [r["steps"] for r in cmp.summary] == [30, 40]
    assert math.isclose(cmp.summary[0]["final_loss"], 4 * 0.99**30) and cmp.summary[1]["best_eval_loss"] == 0.3
    assert cmp._repr_png_()[:4] == b"\x89PNG"
    ax = cmp.figure.axes[0]
    assert ax.get_xlabel() == "step" and ax.get_ylabel() == "loss"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["lr 1e-4", "lr 1e-3"]
    assert "lr 1e-3" in repr(cmp) and "0.3000" in repr(cmp)
    assert [r["label"] for r in compare([a.dir, b.dir]).summary] == ["lr-small", "lr-large"]  # run ids by default
    with pytest.raises(ValueError, match="1 labels for 2 runs"):
        compare([a.dir, b.dir], labels=["x"])
    with pytest.raises(FileNotFoundError, match="not a run directory"):
        compare([tmp_path / "nope"])


def test_memory_flat_over_300_redraws_and_1000_idle_refreshes(run, capsys):
    """300 refreshes that each find a new record (so each redraws the plot), then 1,000 with nothing new: a figure, an
    image or a record kept per redraw (~100 KiB) would grow the process by tens of MiB."""
    d = Dashboard(RunMonitor(run.dir), autostart=False)
    proc = psutil.Process()
    for s in range(1, 51):  # warm-up: fonts, caches, first allocations
        run.train(s)
        d.update()
    gc.collect()
    rss0 = proc.memory_info().rss
    t0 = time.perf_counter()
    for s in range(51, 351):
        run.train(s)
        assert d.update()
    t_redraw = (time.perf_counter() - t0) / 300
    gc.collect()
    rss1 = proc.memory_info().rss
    t0 = time.perf_counter()
    for _ in range(1000):
        assert not d.update()
    t_idle = (time.perf_counter() - t0) / 1000
    rss2 = proc.memory_info().rss
    assert d.redraws == 1 + 50 + 300 and d.progress.value == 350
    report = {"refresh_with_redraw_ms": round(t_redraw * 1e3, 2), "refresh_nothing_new_ms": round(t_idle * 1e3, 3),
              "rss_before_mib": round(rss0 / 2**20, 1), "rss_after_300_redraws_mib": round(rss1 / 2**20, 1),
              "rss_after_1000_idle_refreshes_mib": round(rss2 / 2**20, 1)}
    (ROOT / "artifacts").mkdir(exist_ok=True)
    (ROOT / "artifacts" / "dashboard_refresh_cost.json").write_text(json.dumps(report, indent=1))
    with capsys.disabled():
        print("\ndashboard refresh cost:", report)
    # 300 metric records (about 1 KiB each as dicts) legitimately stay in the monitor; the figure must not grow
    assert rss1 - rss0 < 10 * 2**20, report
    assert rss2 - rss1 < 5 * 2**20, report
    d.close()
