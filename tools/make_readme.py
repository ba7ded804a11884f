"""README.md rendered from nbs/index.ipynb (settings.ini's `readme_nb`), as `nbdev_readme` would without Quarto.

    python tools/make_readme.py           # writes README.md (`make readme`)
    python tools/make_readme.py --check   # exit 1, saying so, when README.md is not what index.ipynb renders to

The rendering is nbconvert's Markdown exporter over the notebook, deterministic: markdown cells as they are; code
cells (none today) as Python blocks with their text outputs; cells marked `#| hide` and nbdev's `#|` lines left out.
tests/test_readme.py fails when README.md and the rendering differ.
"""
import configparser
import re
import sys
from pathlib import Path

import nbformat
from nbconvert import MarkdownExporter

ROOT = Path(__file__).resolve().parents[1]
BANNER = "<!-- Generated from nbs/index.ipynb by tools/make_readme.py (`make readme`): edit the notebook, not this file. -->"


def readme_notebook(root=ROOT) -> Path:
    "The notebook settings.ini names as `readme_nb`, in its `nbs_path`."
    cfg = configparser.ConfigParser()
    cfg.read(root / "settings.ini")
    return root / cfg["DEFAULT"].get("nbs_path", "nbs") / cfg["DEFAULT"].get("readme_nb", "index.ipynb")


def for_readme(nb):
    "The notebook's cells as a reader of the README sees them: no hidden cells, no `#|` directives."
    cells = []
    for c in nb.cells:
        if c.cell_type == "code":
            lines = c.source.splitlines()
            if any(re.match(r"#\|\s*(hide|default_exp|export)", l) for l in lines): continue
            c.source = "\n".join(l for l in lines if not l.startswith("#|")).strip()
            if not c.source: continue
        cells.append(c)
    nb.cells = cells
    return nb


def render(root=ROOT) -> str:
    "README.md's text, rendered from the readme notebook."
    nb = for_readme(nbformat.read(readme_notebook(root), as_version=4))
    body, _ = MarkdownExporter(exclude_input_prompt=True, exclude_output_prompt=True).from_notebook_node(nb)
    body = re.sub(r"\n{3,}", "\n\n", body).strip()
    return f"{BANNER}\n\n{body}\n"


def main(argv):
    readme, text = ROOT / "README.md", render()
    if "--check" in argv:
        if not readme.exists() or readme.read_text() != text:
            sys.exit("README.md is not what nbs/index.ipynb renders to: edit the notebook, then run `make readme`")
        return
    readme.write_text(text)
    print(f"README.md: {text.count(chr(10))} lines from {readme_notebook().relative_to(ROOT)}")


if __name__ == "__main__":
    main(sys.argv[1:])
