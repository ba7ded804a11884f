"""Start-up with Python's cyclic garbage collector on, paused, and paused then frozen, side by side.

    .venv/bin/python bench/bench_startup.py              # ~5 minutes on 2 cores, writes results_startup.md
    .venv/bin/python bench/bench_startup.py --pairs 2 --no-write

Two start-ups, each in a fresh process as they happen for real, timed from outside (wall, and the child's user +
system CPU from the operating system):

- **a rank, through its first steps**: what `python -m ilab_nb.worker` does (import the worker, torch and datasets;
  read the model's config; build, load and set up the demo's tiny model; tokenize the data; write the header; train
  4 steps; write the final model), in one process (`_train`, as nbs/34_worker.ipynb runs it). Four ways: the
  collector on throughout (`on`); off until the first step (`paused`, as ranks started before the freeze); off until
  the first step, with what set-up left frozen (`frozen`: `_train` as a rank runs it, `_AS_RANK`); and frozen, with
  transformers told before its modeling code loads that its object-detection losses go without scipy (`no scipy`:
  `skip_detection_losses`, as a rank's `main` does);
- **a session's preflight**: `FineTuneSession(...)` in a fresh process (imports, data, tokenizer, model config), on and
  paused (`ilab_nb.core.gc_paused`).

The variants of a start-up run back to back, in an order that turns each round, so the machine's drift falls on
all; the table gives the median of each and the median of the rounds' ratios to `on`.
"""
import argparse, datetime, json, os, resource, statistics, subprocess, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

RANK = """
import gc, sys, tempfile
from pathlib import Path
if sys.argv[1] != "on": gc.disable()                   # as a rank started as `python -m ilab_nb.worker` does
import ilab_nb.worker as W
from ilab_nb.config import TrainConfig
from ilab_nb.rundir import RunPaths
W._AS_RANK = sys.argv[1] != "on" and sys.argv[1] != "paused"   # `_train` freezes what the rank set up, as a rank's does
if sys.argv[1] == "no scipy": W.skip_detection_losses()          # as a rank's `main` does since then
rd = RunPaths(Path(tempfile.mkdtemp()) / "run"); rd.logs.mkdir(parents=True)
cfg = TrainConfig(model=sys.argv[2], data=[sys.argv[3]], num_processes=1, strategy="single", device="cpu", max_steps=4,
                  logging_steps=1, max_tokens_per_batch=1024, max_seq_len=256)
cfg.to_json(rd.config)
assert W._train(rd, cfg, W.DistEnv(), "bucketed", W.MetricsWriter(rd.metrics, "run", 1), None) == "completed"
assert gc.isenabled()
"""

PREFLIGHT = """
import sys, tempfile
import ilab_nb.preflight as P, ilab_nb.session as S
if sys.argv[1] == "on": S.preflight = P.preflight.__wrapped__      # the same preflight, without gc_paused
s = S.FineTuneSession(model=sys.argv[2], data=sys.argv[3], device="cpu", num_processes=1, strategy="single", max_steps=2,
                      max_tokens_per_batch=1024, max_seq_len=256, runs_root=tempfile.mkdtemp())
assert s.preflight["num_train_records"] > 0
"""


def timed(code, variant, model, data, python=sys.executable) -> tuple[float, float]:
    "Wall and CPU seconds of one fresh process of `python` running `code`."
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    subprocess.run([python, "-c", code, variant, model, data], check=True, cwd=ROOT,
                   env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def measure(variants, rounds, sample) -> dict:
    """Each variant's median wall and CPU seconds (`sample(variant)`: one of each), and the median of the rounds'
    ratios to the first variant; the variants run in an order that turns each round."""
    got = {v: [] for v in variants}
    for i in range(rounds):
        for v in variants[i % len(variants):] + variants[:i % len(variants)]: got[v].append(sample(v))
    out = {}
    for v in variants:
        out[v] = dict(wall=statistics.median(x[0] for x in got[v]), cpu=statistics.median(x[1] for x in got[v]),
                      cpu_ratio=statistics.median(x[1] / o[1] for x, o in zip(got[v], got[variants[0]])))
    return out


def demo_data() -> tuple[str, str]:
    "The demo model's folder, and the suite's slice of the demo's data (its first 200 conversations)."
    sys.path.insert(0, str(ROOT))
    from ilab_nb.demo import demo_assets
    demo = demo_assets(Path(tempfile.mkdtemp()) / "demo")
    few = Path(tempfile.mkdtemp()) / "train.jsonl"
    few.write_text("".join(demo.train_file.read_text().splitlines(keepends=True)[:200]))
    return str(demo.model_dir), str(few)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=5); ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    model, data = demo_data()
    rows = {"a rank, through its first 4 steps (`_train`)":
                measure(["on", "paused", "frozen", "no scipy"], a.pairs, lambda v: timed(RANK, v, model, data)),
            "a session's preflight (FineTuneSession(...))":
                measure(["on", "paused"], a.pairs, lambda v: timed(PREFLIGHT, v, model, data))}
    lines = [f"# Start-up with the garbage collector on, paused, and paused then frozen; and without scipy\n",
             f"`python bench/bench_startup.py --pairs {a.pairs}`, {datetime.date.today()}, {os.cpu_count()} CPUs, "
             f"Python {sys.version.split()[0]}, one fresh process a sample, medians of {a.pairs} rounds.\n",
             "| start-up | way | wall | CPU | CPU / on |", "|---|---|---:|---:|---:|"]
    for name, r in rows.items():
        for v, x in r.items():
            lines.append(f"| {name} | {v} | {x['wall']:.2f} s | {x['cpu']:.2f} s | {x['cpu_ratio']:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if not a.no_write: (ROOT / "bench" / "results_startup.md").write_text(text)


if __name__ == "__main__":
    main()
