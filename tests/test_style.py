"""The library's code style: no statements joined by `;` (pycodestyle's E702/E703) and lines of at most 120 characters
(E501), in every module the notebooks export. nbdev's own lines are left out: a module's first line (its docstring,
the notebook's one-line description, which test_layers checks) and the `__all__` list nbdev wraps itself. A line that
cannot be cut (a placeholder longer than the room left, a shell line inside a string) says `# noqa: E501`.
Reads files only: no process (so `make test-fast` runs it; the rules are ruff's and pycodestyle's, checked here with
`tokenize`)."""
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIB = ROOT / "ilab_nb"
MAX = 120


def modules():
    return [p for p in sorted(LIB.glob("*.py")) if p.name != "_modidx.py"]


def joined_statements(text):
    "Line numbers of `;` outside brackets: statements joined on one line, or a statement ended by one."
    depth, out = 0, []
    for t in tokenize.generate_tokens(io.StringIO(text).readline):
        if t.type == tokenize.OP:
            if t.string in "([{": depth += 1
            elif t.string in ")]}": depth -= 1
            elif t.string == ";" and depth == 0: out.append(t.start[0])
    return out


def generated_lines(text):
    "nbdev's lines: the module docstring on line 1 and the `__all__` list."
    lines, out = text.splitlines(), {1}
    for i, l in enumerate(lines, 1):
        if l.startswith("__all__ = ["):
            j = i
            while not lines[j - 1].rstrip().endswith("]"): j += 1
            out.update(range(i, j + 1))
    return out


def long_lines(text):
    skip = generated_lines(text)
    return [i for i, l in enumerate(text.splitlines(), 1)
            if len(l) > MAX and i not in skip and not l.rstrip().endswith("# noqa: E501")]


def test_no_statements_joined_by_semicolons():
    bad = {p.name: joined_statements(p.read_text()) for p in modules()}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"`;` joins statements (one a line, in the notebook's exported cell): {bad}"


def test_lines_fit_in_120_characters():
    bad = {p.name: long_lines(p.read_text()) for p in modules()}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"lines over {MAX} characters (wrap them in the notebook's exported cell): {bad}"


def test_the_checks_see_what_they_look_for():
    assert joined_statements("a = 1; b = 2\nif x: c(); d()\nf(a, b)\ns = 'a; b'\nd = {1: 2}\ne = 3;\n") == [1, 2, 6]
    long = "x = " + "1 + " * 40 + "1"
    assert long_lines(f'"""{"d" * 130}"""\n{long}\n{long}  # noqa: E501\n__all__ = [{"x" * 130}]\n') == [2]
