"""What the preflight's data check costs: `FineTuneSession(...)` with and without `check_data`, side by side.

    .venv/bin/python bench/bench_preflight.py              # ~4 minutes on 2 cores, writes results_preflight.md
    .venv/bin/python bench/bench_preflight.py --pairs 1 --no-write

The preflight builds every sample as the ranks will (the chat template, tokenization, the length policy, the batch
plan), so that a data set that leaves nothing, or a sample too long under `long_sequence_policy='error'`, is refused
before launch (nbs/60_preflight.ipynb, `check_data`). That work is new to the preflight; this measures it on the
demo's data (2,400 training and 466 held-out conversations) and on two larger sets made of the same conversations
repeated: 19,200 (checked whole) and 96,000 (over `PREFLIGHT_ROWS`: checked on an even sample of 20,000).

Each pair runs the two variants in fresh processes back to back, in alternating order (with, without, without,
with, ...), so the machine's drift falls on both; the table gives the median of each and the median of the ratios.
"without" is the same preflight with `check_data` replaced by a function that checks nothing.
"""
import argparse, datetime, os, platform, resource, statistics, subprocess, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PREFLIGHT = """
import sys, tempfile
import ilab_nb.preflight as P
if sys.argv[1] == "without": P.check_data = lambda *a, **k: {"total_steps": None}
from ilab_nb.session import FineTuneSession
s = FineTuneSession(model=sys.argv[2], data=sys.argv[3], eval_data=sys.argv[4], device="cpu", num_processes=1,
                    max_seq_len=256, max_tokens_per_batch=1024, runs_root=tempfile.mkdtemp())
assert s.preflight["num_train_records"] > 0 and (sys.argv[1] == "without" or s.preflight["data"]["total_steps"] > 0)
"""


def timed(variant, model, data, evals) -> tuple[float, float]:
    "Wall and CPU seconds of one fresh process."
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", PREFLIGHT, variant, model, data, evals], check=True, cwd=ROOT, capture_output=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def measure(pairs, model, data, evals) -> dict:
    got = {"with": [], "without": []}
    for i in range(pairs):
        for v in (("with", "without") if i % 2 == 0 else ("without", "with")): got[v].append(timed(v, model, data, evals))
    med = lambda v, k: statistics.median(x[k] for x in got[v])
    ratio = lambda k: statistics.median(w[k] / o[k] for w, o in zip(got["with"], got["without"]))
    return dict(with_wall=med("with", 0), without_wall=med("without", 0), wall_ratio=ratio(0),
                with_cpu=med("with", 1), without_cpu=med("without", 1), cpu_ratio=ratio(1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=3); ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from ilab_nb.demo import demo_assets
    from ilab_nb.preflight import PREFLIGHT_ROWS
    tmp = Path(tempfile.mkdtemp())
    demo = demo_assets(tmp / "demo")
    lines = demo.train_file.read_text().splitlines(keepends=True)
    sets = {"the demo's": demo.train_file}
    for times in (8, 40):
        p = tmp / f"train-x{times}.jsonl"; p.write_text("".join(lines * times)); sets[f"x{times}"] = p
    rows = {}
    for name, path in sets.items():
        n = len(path.read_text().splitlines())
        label = f"{n:,} conversations" + (f" ({PREFLIGHT_ROWS:,} checked)" if n > PREFLIGHT_ROWS else "")
        rows[label] = measure(a.pairs, str(demo.model_dir), str(path), str(demo.eval_file))
        print(label, {k: round(v, 2) for k, v in rows[label].items()}, flush=True)
    out = [f"# The preflight's data check: its cost\n",
           f"`python bench/bench_preflight.py --pairs {a.pairs}`, {datetime.date.today()}, {os.cpu_count()} CPUs, "
           f"Python {platform.python_version()}, one fresh process a sample, medians of {a.pairs} pairs; the held-out set "
           f"is the demo's {len(demo.eval_file.read_text().splitlines())} conversations in every row.\n",
           "| training data | wall, with | wall, without | with / without | CPU, with | CPU, without | with / without |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    out += [f"| {k} | {r['with_wall']:.2f} s | {r['without_wall']:.2f} s | {r['wall_ratio']:.2f} | {r['with_cpu']:.2f} s | "
            f"{r['without_cpu']:.2f} s | {r['cpu_ratio']:.2f} |" for k, r in rows.items()]
    text = "\n".join(out) + "\n"
    print(text)
    if not a.no_write: (Path(__file__).parent / "results_preflight.md").write_text(text)


if __name__ == "__main__":
    main()
