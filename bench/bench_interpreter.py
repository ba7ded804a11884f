"""The same start-ups under two Python interpreters, side by side: why `make setup` makes the venv from Debian's
python3.11 where there is one (Makefile's PY).

    python bench/bench_interpreter.py --python A/bin/python --python B/bin/python      # ~5 minutes on 2 cores
    python bench/bench_interpreter.py --python A/bin/python --python B/bin/python --pairs 2 --no-write

Each interpreter is a venv's `python` with this project installed (the same lock in both: only the interpreter may
differ). The start-ups are bench_startup.py's, as they happen for real, each in a fresh process timed from outside
(wall, and the child's user + system CPU from the operating system):

- **a rank, through its first 4 steps**: import the worker, torch and datasets; build and load the demo's tiny model;
  tokenize the data; train 4 steps; write the final model (`_train` as a rank runs it: frozen, without scipy's losses);
- **a session's preflight**: `FineTuneSession(...)` in a fresh process (imports, data, tokenizer, model config).

Every process of a run, and of the test suite, starts with these imports, so their cost is the suite's cost. The
interpreters run back to back, in an order that turns each round, so the machine's drift falls on both; the table
gives the median of each and the median of the rounds' ratios to the first interpreter.
"""
import argparse, datetime, os, resource, statistics, subprocess, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from bench_startup import PREFLIGHT, RANK        # the same start-ups as bench_startup.py's


def timed(python, code, variant, model, data) -> tuple[float, float]:
    "Wall and CPU seconds of one fresh process of `python` running `code`."
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    subprocess.run([python, "-c", code, variant, model, data], check=True, cwd=ROOT,
                   env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def describe(python) -> str:
    "The interpreter's version, where it comes from, and whether it links libpython as a shared library."
    out = subprocess.run([python, "-c", "import sys, sysconfig; print(sys.version.split()[0], sys.base_prefix, "
                          "sysconfig.get_config_var('Py_ENABLE_SHARED'))"], capture_output=True, text=True, check=True)
    version, prefix, shared = out.stdout.split()
    exe = Path(subprocess.run([python, "-c", "import sys, os; print(os.path.realpath(sys.executable))"],
                              capture_output=True, text=True, check=True).stdout.strip())
    linked = subprocess.run(["ldd", str(exe)], capture_output=True, text=True).stdout
    return f"Python {version} from {prefix} ({'libpython shared' if 'libpython' in linked else 'linked statically'})"


def measure(code, variant, pythons, rounds, model, data) -> dict:
    "Each interpreter's median wall and CPU seconds, and the median of the rounds' ratios to the first one."
    got = {p: [] for p in pythons}
    for i in range(rounds):
        for p in pythons[i % len(pythons):] + pythons[:i % len(pythons)]:
            got[p].append(timed(p, code, variant, model, data))
    first = got[pythons[0]]
    return {p: dict(wall=statistics.median(x[0] for x in got[p]), cpu=statistics.median(x[1] for x in got[p]),
                    cpu_ratio=statistics.median(x[1] / o[1] for x, o in zip(got[p], first))) for p in pythons}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--python", action="append", required=True, help="a venv's python (give two or more)")
    ap.add_argument("--pairs", type=int, default=5); ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    if len(a.python) < 2: ap.error("give --python twice: the interpreters to compare")
    sys.path.insert(0, str(ROOT))
    from ilab_nb.demo import demo_assets
    demo = demo_assets(Path(tempfile.mkdtemp()) / "demo")
    few = Path(tempfile.mkdtemp()) / "train.jsonl"                        # the suite's slice of the demo's data
    few.write_text("".join(demo.train_file.read_text().splitlines(keepends=True)[:200]))
    names = {p: describe(p) for p in a.python}
    rows = {"a rank, through its first 4 steps (`_train`)":
                measure(RANK, "no scipy", a.python, a.pairs, str(demo.model_dir), str(few)),
            "a session's preflight (FineTuneSession(...))":
                measure(PREFLIGHT, "paused", a.python, a.pairs, str(demo.model_dir), str(few))}
    lines = ["# The same start-ups under two Python interpreters\n",
             f"`python bench/bench_interpreter.py --python A --python B --pairs {a.pairs}`, {datetime.date.today()}, {os.cpu_count()} CPUs, "
             f"one fresh process a sample, medians of {a.pairs} rounds. The interpreters:\n"]
    lines += [f"- `{p}`: {names[p]}" for p in a.python]
    lines += ["", "| start-up | interpreter | wall | CPU | CPU / first |", "|---|---|---:|---:|---:|"]
    for name, r in rows.items():
        for p, x in r.items():
            lines.append(f"| {name} | {names[p]} | {x['wall']:.2f} s | {x['cpu']:.2f} s | {x['cpu_ratio']:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if not a.no_write: (ROOT / "bench" / "results_interpreter.md").write_text(text)


if __name__ == "__main__":
    main()
