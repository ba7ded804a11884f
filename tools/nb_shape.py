"""How the notebooks read, in numbers (issue: the notebooks as a book). Run from the repository root:

    python tools/nb_shape.py            # one line per notebook and a total
    python tools/nb_shape.py --worst 10 # also the longest exported cells

Counts, per notebook: exported cells, their median and largest size (non-blank lines), how many are over 30
lines (the book's limit; data tables excepted by eye), the share followed straight away by a check (the next code cell is not exported and asserts or calls a
test helper), and classes that subclass themselves (`class X(X):`) in the generated library. Outside
`ilab_nb/rundir.py` (the run directory's contract), it lists every string constant that is a state name or
names a file of the run directory: modules use `State` and `RunPaths` (and `Event`) instead.
"""
import argparse, ast, json, re, statistics, sys
from pathlib import Path

EXPORT = re.compile(r"\s*#\|\s*export")
CHECK = re.compile(r"\bassert\b|\btest_\w+\(|pytest\.raises")


def cells(nb):
    return ["".join(c["source"]) for c in json.loads(Path(nb).read_text())["cells"] if c["cell_type"] == "code"]


def shape(nb):
    src, out = cells(nb), []
    for i, s in enumerate(src):
        if not EXPORT.match(s): continue
        nxt = src[i + 1] if i + 1 < len(src) else ""
        out.append((len([l for l in s.splitlines() if l.strip() and not l.lstrip().startswith("#|")]),
                    bool(not EXPORT.match(nxt) and CHECK.search(nxt)), s.splitlines()[1:2]))
    return out


# String constants that look like the contract's names but are not: message words, another format's file names.
NOT_CONTRACT = {("launcher.py", "failed"), ("slurm.py", "failed"),   # "rank 1 failed" when no exit code is known
                ("data.py", "state.json")}                            # a `datasets.save_to_disk` folder's own file


def contract_literals():
    "`(file:line, value)` of string constants outside rundir.py that spell a state or a file of the run directory."
    from ilab_nb.rundir import RunPaths, State
    files = {q.name for p in vars(RunPaths).values() if isinstance(p, property)
             for q in [p.fget(RunPaths("/r"))] if isinstance(q, Path) and "." in q.name} - {"config.json"}  # a model's too
    out = []
    for py in sorted(Path("ilab_nb").glob("*.py")):
        if py.name in ("rundir.py", "_modidx.py"): continue
        for node in ast.walk(ast.parse(py.read_text())):
            v = getattr(node, "value", None) if isinstance(node, ast.Constant) else None
            if isinstance(v, str) and (v in set(State) or v in files) and (py.name, v) not in NOT_CONTRACT:
                out.append((f"{py}:{node.lineno}", v))
    return out


def main():
    ap = argparse.ArgumentParser(); ap.add_argument("--worst", type=int, default=0); a = ap.parse_args()
    rows, allc = [], []
    for nb in sorted(Path("nbs").glob("*.ipynb")):
        c = shape(nb)
        if not c: continue
        allc += [(nb.name, *x) for x in c]
        sizes = [n for n, _, _ in c]
        rows.append((nb.name, len(c), statistics.median(sizes), max(sizes), sum(n > 30 for n in sizes),
                     sum(k for _, k, _ in c) / len(c)))
    print(f"{'notebook':24} {'cells':>5} {'median':>6} {'max':>4} {'>30':>4} {'checked':>7}")
    for r in rows: print(f"{r[0]:24} {r[1]:5d} {r[2]:6.1f} {r[3]:4d} {r[4]:4d} {r[5]:7.0%}")
    sizes = [x[1] for x in allc]
    selfsub = sorted({m for p in Path("ilab_nb").glob("*.py") for m in re.findall(r"class (\w+)\(\1\)", p.read_text())})
    print(f"\nall: {len(allc)} exported cells, median {statistics.median(sizes):.1f} lines, {sum(n > 30 for n in sizes)} over 30, "
          f"{sum(x[2] for x in allc) / len(allc):.0%} followed by a check; classes subclassing themselves: {selfsub or 'none'}")
    lits = contract_literals()
    print(f"state names and run-directory files spelled as literals outside rundir.py: {len(lits)}")
    for where, v in lits: print(f"  {where}  {v!r}")
    for nb, n, _, first in sorted(allc, key=lambda x: -x[1])[:a.worst]: print(f"  {n:4d}  {nb}  {first[0][:70] if first else ''}")


if __name__ == "__main__": sys.exit(main())
