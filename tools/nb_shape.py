"""How the notebooks read, in numbers (issue: the notebooks as a book). Run from the repository root:

    python tools/nb_shape.py            # one line per notebook and a total
    python tools/nb_shape.py --worst 10 # also the longest exported cells

Counts, per notebook: exported cells, their median and largest size (non-blank lines), how many are over 40
lines, the share followed straight away by a check (the next code cell is not exported and asserts or calls a
test helper), and classes that subclass themselves (`class X(X):`) in the generated library.
"""
import argparse, json, re, statistics, sys
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


def main():
    ap = argparse.ArgumentParser(); ap.add_argument("--worst", type=int, default=0); a = ap.parse_args()
    rows, allc = [], []
    for nb in sorted(Path("nbs").glob("*.ipynb")):
        c = shape(nb)
        if not c: continue
        allc += [(nb.name, *x) for x in c]
        sizes = [n for n, _, _ in c]
        rows.append((nb.name, len(c), statistics.median(sizes), max(sizes), sum(n > 40 for n in sizes),
                     sum(k for _, k, _ in c) / len(c)))
    print(f"{'notebook':24} {'cells':>5} {'median':>6} {'max':>4} {'>40':>4} {'checked':>7}")
    for r in rows: print(f"{r[0]:24} {r[1]:5d} {r[2]:6.1f} {r[3]:4d} {r[4]:4d} {r[5]:7.0%}")
    sizes = [x[1] for x in allc]
    selfsub = sorted({m for p in Path("ilab_nb").glob("*.py") for m in re.findall(r"class (\w+)\(\1\)", p.read_text())})
    print(f"\nall: {len(allc)} exported cells, median {statistics.median(sizes):.1f} lines, {sum(n > 40 for n in sizes)} over 40, "
          f"{sum(x[2] for x in allc) / len(allc):.0%} followed by a check; classes subclassing themselves: {selfsub or 'none'}")
    for nb, n, _, first in sorted(allc, key=lambda x: -x[1])[:a.worst]: print(f"  {n:4d}  {nb}  {first[0][:70] if first else ''}")


if __name__ == "__main__": sys.exit(main())
