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
import argparse, datetime, json, math, os, platform, shutil, statistics, sys, tempfile, time
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


FAKE_SAMPLES = dict(kind="samples", seconds=0.5, samples=[
    dict(prompt=f"Held-out question number {i} about the atlas?", answer="a sixteen token answer " * 3) for i in range(4)])


def dense_records(header, n=1000):
    "A run that logs every step: `n` train records shaped like the demo's (falling loss, warm-up then cosine), eval every 100."
    out = [dict(header, total_steps=n)]
    for s in range(1, n + 1):
        lr = 3e-3 * min(s / 20, 0.5 * (1 + math.cos(math.pi * s / n)))
        out.append(dict(kind="train", step=s, total_steps=n, epoch=s / n, loss=6.7 * math.exp(-s / 40) + 0.01 + 0.05 * math.sin(s),
                        learning_rate=lr, tokens=2000, tokens_per_s=900.0, elapsed_s=0.5 * s, time=header["time"] + 0.5 * s))
        if s % 100 == 0: out.append(dict(kind="eval", step=s, epoch=s / n, eval_loss=6.7 * math.exp(-s / 40) + 0.02, time=header["time"] + 0.5 * s))
    return out


def replay(run_dir, samples=True, dense=0):
    """`Dashboard.update()` after each record of a finished run, appended one at a time to a copy of it (with 4 sample
    answers after each evaluation where the run has none); `dense`: instead, that many steps that each log a record."""
    from ilab_nb.dashboard import Dashboard
    src = RunMonitor(run_dir); src.poll()
    recs = dense_records(src.records[0], dense) if dense else list(src.records)
    have = any(r["kind"] == "samples" for r in recs)
    tmp = Path(tempfile.mkdtemp()) / Path(run_dir).name
    shutil.copytree(run_dir, tmp, ignore=shutil.ignore_patterns("checkpoints", "final", "cache", "metrics.jsonl"))
    (tmp / "metrics.jsonl").write_text(json.dumps(recs[0]) + "\n")
    t = time.perf_counter(); d = Dashboard(RunMonitor(tmp), autostart=False); first = time.perf_counter() - t
    if not samples: d._show_samples = lambda: False
    d.update(); bg0, times, panel = d.plot.backgrounds, [], []
    for r in recs[1:]:
        extra = [dict(FAKE_SAMPLES, step=r["step"])] if r["kind"] == "eval" and not have else []
        with open(tmp / "metrics.jsonl", "a") as f:
            f.writelines(json.dumps(x) + "\n" for x in [r] + extra)
        t = time.perf_counter(); d.update(); times.append(time.perf_counter() - t)
        if samples and extra:
            d._samples_n = None
            t = time.perf_counter(); d._show_samples(); panel.append(time.perf_counter() - t)
    d.close(); shutil.rmtree(tmp.parent, ignore_errors=True)
    return dict(times=sorted(times), backgrounds=d.plot.backgrounds - bg0, panel=panel, first=first,
                rows=d.samples_view.value.count("<tr>") - 1 if samples else 0)


def dashboard_refresh(run_dir):
    return {"demo": replay(run_dir), "demo, no samples panel": replay(run_dir, samples=False), "dense": replay(run_dir, dense=1000)}


def dashboard_rows(dash):
    ms = lambda t, q: f"{1000 * t[min(len(t) - 1, int(q * len(t)))]:.1f}"
    what = {"demo": "the run replayed record by record, sample answers shown",
            "demo, no samples panel": "the same without the samples panel",
            "dense": "1,000 steps that each log a record (the run's header), sample answers shown"}
    rows = ["| replay | refreshes | whole-figure draws | median | 90th percentile | max | building the dashboard (its first refresh) |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    rows += [f"| {what[k]} | {len(v['times'])} | {v['backgrounds']} | {ms(v['times'], .5)} ms | {ms(v['times'], .9)} ms | {ms(v['times'], 1)} ms "
             f"| {1000 * v['first']:.1f} ms |" for k, v in dash.items()]
    panel = sorted(dash["demo"]["panel"] + dash["dense"]["panel"])
    rows += ["", f"The samples panel alone ({dash['demo']['rows']} prompts): median {1000 * statistics.median(panel):.2f} ms of {len(panel)}."]
    return rows


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
        f"| chat: held-out question answered by the final model | {answer!r} (expected {chat_item['expected']!r}), {chat_s:.2f} s streamed in {len(pieces)} pieces |",
        "", "Answers at the first and the last evaluation:", "",
        "| question | expected | step " + str(first["step"]) + " | step " + str(last["step"]) + " |", "|---|---|---|---|",
    ]
    lines += [f"| {it['question']} | {it['expected']} | {x['answer']!r} | {y['answer']!r} |" for it, x, y in zip(held, first["samples"], last["samples"])]
    lines += ["", "Dashboard refresh (`Dashboard.update()`) replaying this run:", "", *dashboard_rows(dash)]
    text = "\n".join(lines) + "\n"
    print(text)
    if not a.no_write: (Path(__file__).parent / "results_experiments.md").write_text(text)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
