"""Start-up with Python's cyclic garbage collector on against paused (`ilab_nb.core.gc_paused`), side by side.

    .venv/bin/python bench/bench_startup.py              # ~3 minutes on 2 cores, writes results_startup.md
    .venv/bin/python bench/bench_startup.py --pairs 2 --no-write

Two start-ups, each in a fresh process as they happen for real, timed from outside (wall, and the child's user +
system CPU from the operating system):

- **a rank's set-up**: what `python -m ilab_nb.worker` does before its first step (import the worker, torch and
  datasets; read the model's config; build, load and set up the demo's tiny model; tokenize the data; write the
  header), in one process (`setup_attempt` + `write_header`, as nbs/34_worker.ipynb runs them);
- **a session's preflight**: `FineTuneSession(...)` in a fresh process (imports, data, tokenizer, model config).

Each pair runs the two variants back to back in alternating order (on, paused, paused, on, ...), so the machine's
drift falls on both; the table gives the median of each and the median of the pairs' ratios.
"""
import argparse, datetime, json, os, resource, statistics, subprocess, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

RANK = """
import gc, sys, tempfile
from pathlib import Path
if sys.argv[1] == "paused": gc.disable()                   # as a rank started as `python -m ilab_nb.worker` does
from ilab_nb.worker import DistEnv, MetricsWriter, setup_attempt
from ilab_nb.config import TrainConfig
from ilab_nb.rundir import RunPaths
rd = Path(tempfile.mkdtemp()) / "run"; RunPaths(rd).logs.mkdir(parents=True)
cfg = TrainConfig(model=sys.argv[2], data=[sys.argv[3]], num_processes=1, strategy="single", device="cpu", max_steps=2,
                  logging_steps=1, max_tokens_per_batch=1024, max_seq_len=256)
a = setup_attempt(rd, cfg, DistEnv(), "bucketed", MetricsWriter(RunPaths(rd).metrics, "run", 1))
a.write_header()
gc.enable()
assert len(a.steps) == 2
"""

PREFLIGHT = """
import sys, tempfile
import ilab_nb.preflight as P, ilab_nb.session as S
if sys.argv[1] == "on": S.preflight = P.preflight.__wrapped__      # the same preflight, without gc_paused
s = S.FineTuneSession(model=sys.argv[2], data=sys.argv[3], device="cpu", num_processes=1, strategy="single", max_steps=2,
                      max_tokens_per_batch=1024, max_seq_len=256, runs_root=tempfile.mkdtemp())
assert s.preflight["num_train_records"] > 0
"""


def timed(code, variant, model, data) -> tuple[float, float]:
    "Wall and CPU seconds of one fresh process running `code`."
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", code, variant, model, data], check=True, cwd=ROOT,
                   env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def measure(code, pairs, model, data) -> dict:
    got = {"on": [], "paused": []}
    for i in range(pairs):
        for v in (("on", "paused") if i % 2 == 0 else ("paused", "on")): got[v].append(timed(code, v, model, data))
    med = lambda v, k: statistics.median(x[k] for x in got[v])
    ratio = lambda k: statistics.median(p[k] / o[k] for p, o in zip(got["paused"], got["on"]))
    return dict(on_wall=med("on", 0), on_cpu=med("on", 1), paused_wall=med("paused", 0), paused_cpu=med("paused", 1),
                wall_ratio=ratio(0), cpu_ratio=ratio(1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=5); ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from ilab_nb.demo import demo_assets
    demo = demo_assets(Path(tempfile.mkdtemp()) / "demo")
    few = Path(tempfile.mkdtemp()) / "train.jsonl"                        # the suite's slice of the demo's data
    few.write_text("".join(demo.train_file.read_text().splitlines(keepends=True)[:200]))
    rows = {"a rank's set-up (to its header)": measure(RANK, a.pairs, str(demo.model_dir), str(few)),
            "a session's preflight (FineTuneSession(...))": measure(PREFLIGHT, a.pairs, str(demo.model_dir), str(few))}
    lines = [f"# Start-up with the garbage collector on and paused\n",
             f"`python bench/bench_startup.py --pairs {a.pairs}`, {datetime.date.today()}, {os.cpu_count()} CPUs, "
             f"Python {sys.version.split()[0]}, one fresh process a sample, medians of {a.pairs} pairs.\n",
             "| start-up | wall, on | wall, paused | paused / on | CPU, on | CPU, paused | paused / on |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['on_wall']:.2f} s | {r['paused_wall']:.2f} s | {r['wall_ratio']:.2f} | "
                     f"{r['on_cpu']:.2f} s | {r['paused_cpu']:.2f} s | {r['cpu_ratio']:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if not a.no_write: (ROOT / "bench" / "results_startup.md").write_text(text)


if __name__ == "__main__":
    main()
