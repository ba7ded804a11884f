"""The notebooks' numbers show the layers: a module's notebook never imports a module whose notebook is numbered
above it (so there is no import circle either), and each module's docstring is its notebook's whole one-line
description. The tutorial keeps the outputs of a real run. Reads files only: no process, no import of the package."""
import ast
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NBS, LIB = ROOT / "nbs", ROOT / "ilab_nb"


def notebook_number(name):
    "The number a notebook's name starts with; `index.ipynb`, the front page, is 0."
    m = re.match(r"(\d+)_", name)
    return int(m.group(1)) if m else 0


def exported_modules():
    "{module name: notebook file name} from each notebook's `#| default_exp`."
    found = {}
    for p in sorted(NBS.glob("*.ipynb")):
        for c in json.loads(p.read_text())["cells"]:
            m = re.search(r"^#\|\s*default_exp\s+(\S+)", "".join(c["source"]), re.M)
            if m and c["cell_type"] == "code": found[m.group(1)] = p.name
    return found


def package_imports(module):
    "The package's modules `module` imports anywhere in its file (at the top or inside a function)."
    tree = ast.parse((LIB / f"{module.replace('.', '/')}.py").read_text())
    deps = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom):
            if n.level: deps.add((n.module or "").split(".")[0])
            elif n.module and n.module.startswith("ilab_nb."): deps.add(n.module.split(".")[1])
            elif n.module == "ilab_nb": deps.update(a.name for a in n.names)
        elif isinstance(n, ast.Import):
            deps.update(a.name.split(".")[1] for a in n.names if a.name.startswith("ilab_nb."))
    return deps - {"", module}


def upward_imports(mods=None):
    "Every (notebook, the higher-numbered notebook whose module it imports, that module)."
    mods = mods or exported_modules()
    return [(nb, mods[d], d) for m, nb in mods.items() for d in sorted(package_imports(m))
            if d in mods and notebook_number(mods[d]) >= notebook_number(nb)]


def test_every_notebook_has_its_own_number():
    names = [p.name for p in NBS.glob("*.ipynb")]
    numbers = [notebook_number(n) for n in names]
    assert len(set(numbers)) == len(numbers), sorted(names)


def test_no_notebook_imports_one_numbered_above_it():
    mods = exported_modules()
    assert {"worker", "session", "config", "__init__"} <= set(mods), mods   # the scan found the notebooks
    assert "trackers" in package_imports("worker")                         # ... and the imports, lazy ones too
    bad = upward_imports(mods)
    assert not bad, "\n".join(f"{a} imports {m} from {b}: renumber so it stands below" for a, b, m in bad)


def test_the_check_sees_an_upward_import():
    mods = exported_modules() | {"config": "99_config.ipynb"}            # config numbered above what imports it
    assert any(b == "99_config.ipynb" and m == "config" for _, b, m in upward_imports(mods))


def description(nb_path):
    "The `>` line of a notebook's first markdown cell, and the line after it."
    cells = json.loads(nb_path.read_text())["cells"]
    lines = "".join(next(c for c in cells if c["cell_type"] == "markdown")["source"]).split("\n") + [""]
    i = next(k for k, l in enumerate(lines) if l.startswith(">"))
    return lines[i][1:].strip(), lines[i + 1]


def test_module_docstrings_are_whole_descriptions():
    for module, nb in exported_modules().items():
        desc, after = description(NBS / nb)
        assert not after.startswith(">"), f"{nb}: the description goes on to a second `>` line; nbdev keeps only the first"
        assert desc.endswith((".", ")")), f"{nb}: the description does not end a sentence: {desc!r}"
        text = (LIB / f"{module}.py").read_text()
        doc = ast.get_docstring(ast.parse(text)) or re.search(r'^"""(.*)"""$', text, re.M).group(1)
        assert doc == desc, (module, doc, desc)


def test_the_tutorial_is_stored_with_its_outputs():
    "Stored by tools/store_outputs.py from a real run; test_notebooks_headless checks they are current."
    nb = json.loads((NBS / "01_tutorial.ipynb").read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    outs = [o for c in code for o in c["outputs"]]
    assert sum(bool(c["outputs"]) for c in code) >= len(code) - 2, "the tutorial's cells were saved without outputs"
    assert not [o for o in outs if o["output_type"] == "error"]
    assert not [o for o in outs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]  # records, not widgets
    html = "".join("".join(o.get("data", {}).get("text/html", "")) for o in outs)
    assert html.count('class="ilab-record"') >= 3 and "ilab-sweep-record" in html and "ilab-chat-record" in html
    assert "widgets" not in nb["metadata"]


def test_output_shape_sees_a_lost_record_not_new_numbers():
    import importlib.util
    import nbformat
    spec = importlib.util.spec_from_file_location("store", ROOT / "tools" / "store_outputs.py")
    store = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(store)
    nb = nbformat.read(NBS / "01_tutorial.ipynb", as_version=4)
    shape = store.output_shape(nb)
    for c in nb.cells:                                   # other numbers, other run ids: the same shape
        for o in c.get("outputs", []):
            if o["output_type"] == "stream": o.text = o.text.replace("1", "7")
    assert store.output_shape(nb) == shape
    cell = next(c for c in nb.cells if c.cell_type == "code" and any("ilab-sweep-record" in o.get("data", {}).get("text/html", "")
                                                                    for o in c.outputs))
    cell.outputs = []                                    # the sweep's record lost: stale
    assert store.output_shape(nb) != shape
