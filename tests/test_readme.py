"""README.md is the front page rendered from nbs/index.ipynb (settings.ini's `readme_nb`) by tools/make_readme.py:
this fails when someone edits one and not the other. Files only: no process."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("make_readme", ROOT / "tools" / "make_readme.py")
make_readme = importlib.util.module_from_spec(spec)
spec.loader.exec_module(make_readme)


def test_readme_is_the_rendering_of_the_index_notebook():
    assert make_readme.readme_notebook() == ROOT / "nbs" / "index.ipynb"
    text = make_readme.render()
    assert (ROOT / "README.md").read_text() == text, \
        "README.md is not what nbs/index.ipynb renders to: edit the notebook, then run `make readme`"


def test_readme_is_a_front_door():
    text = make_readme.render()
    assert 120 <= text.count("\n") <= 250, text.count("\n")
    heads = [l for l in text.splitlines() if l.startswith("## ")]
    assert heads == ["## Install", "## Quick start", "## The command line", "## Read next"], heads
    assert 'pip install "ilab_nb[eval,export] @ git+' in text and "make demo" in text and "make test" in text


def test_the_rendering_leaves_out_nbdev_directives(tmp_path):
    import nbformat
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# t\n\n> d."),
                                         nbformat.v4.new_code_cell("#| default_exp x\n"),
                                         nbformat.v4.new_code_cell("#| hide\nsecret = 1"),
                                         nbformat.v4.new_code_cell("#| notest\n1 + 1")])
    (tmp_path / "nbs").mkdir()
    nbformat.write(nb, tmp_path / "nbs" / "index.ipynb")
    (tmp_path / "settings.ini").write_text("[DEFAULT]\nnbs_path = nbs\nreadme_nb = index.ipynb\n")
    text = make_readme.render(tmp_path)
    assert "# t" in text and "1 + 1" in text and "secret" not in text and "#|" not in text


def test_read_next_names_every_notebook_and_explanation():
    text = (ROOT / "README.md").read_text()
    missing = [p.stem for p in (ROOT / "nbs").glob("[0-9]*.ipynb") if p.stem not in text]
    missing += [p.name for p in (ROOT / "nbs" / "explanations").glob("*.md") if f"`{p.name}`" not in text]
    assert not missing, f"README's 'Read next' (nbs/index.ipynb) does not name {missing}"
