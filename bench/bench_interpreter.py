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
import argparse, datetime, os, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from bench_startup import PREFLIGHT, RANK, demo_data, measure, timed     # bench_startup.py's start-ups


def describe(python) -> str:
    "The interpreter's version, where it comes from, and whether it links libpython as a shared library."
    out = subprocess.run([python, "-c", "import os, sys; print(sys.version.split()[0], sys.base_prefix, "
                          "os.path.realpath(sys.executable))"], capture_output=True, text=True, check=True)
    version, prefix, exe = out.stdout.split()
    linked = subprocess.run(["ldd", str(exe)], capture_output=True, text=True).stdout
    return f"Python {version} from {prefix} ({'libpython shared' if 'libpython' in linked else 'linked statically'})"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--python", action="append", required=True, help="a venv's python (give two or more)")
    ap.add_argument("--pairs", type=int, default=5); ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    if len(a.python) < 2: ap.error("give --python twice: the interpreters to compare")
    model, data = demo_data()
    names = {p: describe(p) for p in a.python}
    rows = {"a rank, through its first 4 steps (`_train`)":          # as a rank runs it: frozen, without scipy
                measure(a.python, a.pairs, lambda p: timed(RANK, "no scipy", model, data, python=p)),
            "a session's preflight (FineTuneSession(...))":
                measure(a.python, a.pairs, lambda p: timed(PREFLIGHT, "paused", model, data, python=p))}
    lines = ["# The same start-ups under two Python interpreters\n",
             f"`python bench/bench_interpreter.py --python A --python B --pairs {a.pairs}`, {datetime.date.today()}, "
             f"{os.cpu_count()} CPUs, one fresh process a sample, medians of {a.pairs} rounds. The interpreters:\n"]
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
