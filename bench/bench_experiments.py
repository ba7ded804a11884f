"""Cost of issue 11's experiment features on this machine's CPU, with the demo (2 gloo ranks, FSDP, 240 steps,
evaluation every 60 steps):

- sample answers: the demo run with 4 held-out eval prompts; overhead = seconds spent generating (from the
  `samples` records, every rank generates in lockstep) / the rest of the run's wall time; with --baseline also
  a run without prompts, for the wall-clock difference (noisy on a shared machine);
- the held-out prompts' answers at step 0 and at the end (the demo model learns its atlas);
- the dashboard's refresh with the samples panel shown: `Dashboard.update()` after each append of one train
  and one samples record to a finished run's metrics (plot redraw included), and the samples panel alone;
- chat: the final model answers a held-out question through `ilab_nb.chat.Chat` (streamed).

    .venv/bin/python bench/bench_experiments.py               # one demo run (minutes); writes results_experiments.md
    .venv/bin/python bench/bench_experiments.py --baseline    # and a run without prompts
"""
import argparse, datetime, json, os, platform, shutil, statistics, sys, tempfile, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["PYTHONPATH"] = str(Path(__file__).resolve().parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", "")

from ilab_nb.demo import demo_assets, read_chat_jsonl, answer_prompts
from ilab_nb.monitor import RunMonitor
from ilab_nb.session import FineTuneSession


def wall_s(run_dir):
    m = RunMonitor(run_dir); m.poll()
    h = next(r for r in m.records if r["kind"] == "header")
    end = next(r for r in m.records if r.get("event") == "completed")
    return end["time"] - h["time"], m.records


def demo_run(demo, root, **kw):
    s = FineTuneSession(**demo.train_config(**kw), runs_root=root)
    s.start()
    status = s.wait()
    if status != "completed": raise SystemExit(f"demo run {s.run_id} {status}: {s.reason}\n{s.logs(30)}")
    return s


def dashboard_refresh(run_dir, n=20):
    "Median and max of `Dashboard.update()` after appending a train and a samples record; the same without the panel; the panel alone."
    from ilab_nb.dashboard import Dashboard
    tmp = Path(tempfile.mkdtemp()) / Path(run_dir).name
    shutil.copytree(run_dir, tmp, ignore=shutil.ignore_patterns("checkpoints", "final", "cache"))
    d = Dashboard(RunMonitor(tmp), autostart=False)
    recs = list(d.monitor.records)
    last_train = [r for r in recs if r["kind"] == "train"][-1]
    last_samples = ([r for r in recs if r["kind"] == "samples"] or [dict(kind="samples", seconds=0.5, samples=[
        dict(prompt=f"Held-out question number {i} about the atlas?", answer="a sixteen token answer " * 3) for i in range(4)])])[-1]
    full, without, panel = [], [], []
    d.update(); bg0 = d.plot.backgrounds
    for i in range(2 * n):
        with open(tmp / "metrics.jsonl", "a") as f:
            f.write(json.dumps({**last_train, "step": last_train["step"] + i + 1}) + "\n")
            f.write(json.dumps({**last_samples, "step": last_train["step"] + i + 1}) + "\n")
        t = time.perf_counter()
        if i % 2: d.update()
        else: d._show_samples = lambda: False; d.update(); del d._show_samples   # the refresh without the samples panel
        (full if i % 2 else without).append(time.perf_counter() - t)
        d._samples_n = None
        t = time.perf_counter(); d._show_samples(); panel.append(time.perf_counter() - t)
    return dict(full=(statistics.median(full), max(full)), without=statistics.median(without),
                panel=statistics.median(panel), rows=d.samples_view.value.count("<tr>") - 1,
                backgrounds=d.plot.backgrounds - bg0)


def dashboard_rows(dash):
    return [f"| dashboard `update()` with samples shown, new records each time (median / max of 20) | {1000 * dash['full'][0]:.1f} / {1000 * dash['full'][1]:.1f} ms |",
            f"| of those 40 refreshes, how many drew the whole figure (the axis limits moved; the rest only paint the data) | {dash['backgrounds']} |",
            f"| the same refresh without the samples panel (median of 20) | {1000 * dash['without']:.1f} ms |",
            f"| samples panel alone (median of 40, {dash['rows']} prompts) | {1000 * dash['panel']:.2f} ms |"]


def main():
    ap = argparse.ArgumentParser(); ap.add_argument("--baseline", action="store_true"); ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--max-steps", type=int, default=240, help="the demo's 240 by default")
    ap.add_argument("--dashboard", metavar="RUN_DIR", help="only measure the dashboard refresh on a copy of RUN_DIR")
    a = ap.parse_args()
    if a.dashboard:
        print(f"load average {os.getloadavg()[0]:.2f}"); print("\n".join(dashboard_rows(dashboard_refresh(a.dashboard)))); return
    root = Path(tempfile.mkdtemp(prefix="ilab-bench-exp-"))
    os.environ.setdefault("ILAB_NB_LOCKS", str(root / "locks"))
    demo = demo_assets(root / "demo")
    items = answer_prompts(read_chat_jsonl(demo.eval_file))
    held = [it for it in items if len(it["context"]) == 2][:5]           # system + first question of a conversation
    prompts, chat_item = [it["context"] for it in held[:4]], held[4]
    s = demo_run(demo, root / "runs", eval_prompts=prompts, eval_max_new_tokens=16, max_steps=a.max_steps)
    wall, recs = wall_s(s.run_dir)
    samples = [r for r in recs if r["kind"] == "samples"]
    gen = sum(r["seconds"] for r in samples)
    base = None
    if a.baseline:
        b = demo_run(demo, root / "runs", max_steps=a.max_steps)
        base, _ = wall_s(b.run_dir)
    first, last = samples[0], samples[-1]
    right = lambda r: sum(x["answer"] == it["expected"] for x, it in zip(r["samples"], held))
    dash = dashboard_refresh(s.run_dir)
    from ilab_nb.chat import Chat
    model, tok = s.load_model()
    c = Chat(model, tok, system=chat_item["context"][0]["content"], max_new_tokens=16)
    t = time.perf_counter(); pieces = list(c.ask(chat_item["question"])); chat_s = time.perf_counter() - t
    answer = "".join(pieces).strip()

    import torch, transformers
    per_eval = ", ".join(f"{r['seconds']:.2f}" for r in samples)
    lines = [
        "# Experiment features benchmark (measured by `bench/bench_experiments.py`)", "",
        f"{datetime.date.today()}, {platform.processor() or platform.machine()}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"load average {os.getloadavg()[0]:.2f} at the end ({os.cpu_count()} cores, shared with other work).",
        f"Demo run: 2 gloo ranks, FSDP, {samples[-1]['step']} steps, evaluation every 60 steps and at each epoch's end ({len(samples)} evaluations incl. step 0), "
        f"4 eval prompts, eval_max_new_tokens=16.", "",
        "| measure | value |", "|---|---:|",
        f"| run wall time (header to completed) | {wall:.1f} s |",
        f"| sample generation, all evaluations | {gen:.2f} s ({per_eval}) |",
        f"| sample generation overhead (generation / rest of the run) | {100 * gen / (wall - gen):.1f} % |",
    ]
    if base is not None:
        lines.append(f"| wall time of the same run without prompts | {base:.1f} s ({100 * (wall - base) / base:+.1f} %, noisy) |")
    lines += [
        f"| held-out prompts answered right at step {first['step']} / at step {last['step']} | {right(first)}/4 / {right(last)}/4 |",
        *dashboard_rows(dash),
        f"| chat: held-out question answered by the final model | {answer!r} (expected {chat_item['expected']!r}), {chat_s:.2f} s streamed in {len(pieces)} pieces |",
        "", "Answers at the first and the last evaluation:", "",
        "| question | expected | step " + str(first["step"]) + " | step " + str(last["step"]) + " |", "|---|---|---|---|",
    ]
    lines += [f"| {it['question']} | {it['expected']} | {x['answer']!r} | {y['answer']!r} |" for it, x, y in zip(held, first["samples"], last["samples"])]
    text = "\n".join(lines) + "\n"
    print(text)
    if not a.no_write: (Path(__file__).parent / "results_experiments.md").write_text(text)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
