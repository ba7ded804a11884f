"""Authoring aid (dev only): edit a notebook as a py:percent text file and write it back as a clean .ipynb.

    python tools/nbedit.py to-py nbs/12_config.ipynb /tmp/12_config.py   # notebook -> editable text
    python tools/nbedit.py to-nb /tmp/12_config.py nbs/12_config.ipynb   # text -> notebook

A code cell whose source is unchanged keeps its stored outputs (the tutorial's); an edited or new one has none.

The notebook stays the source of truth; the text file is a scratch copy. Uses jupytext (pip install jupytext).
"""
import sys, jupytext, nbformat

def to_py(nb_path, py_path): jupytext.write(jupytext.read(nb_path), py_path, fmt='py:percent')

def to_nb(py_path, nb_path):
    nb = jupytext.read(py_path, fmt='py:percent')
    nb.metadata = {'kernelspec': {'display_name': 'python3', 'language': 'python', 'name': 'python3'}}
    try: old = nbformat.read(nb_path, as_version=4).cells   # keep cell ids (and so the library's diffs) stable
    except FileNotFoundError: old = []
    by_source = {c.source: c.get('id') for c in old}
    outputs = {c.source: (c.outputs, c.execution_count) for c in old if c.cell_type == 'code'}
    for i, c in enumerate(nb.cells):
        c.metadata = {}
        if c.cell_type == 'code': c.outputs, c.execution_count = outputs.get(c.source, ([], None))
        keep = by_source.get(c.source) or (old[i].get('id') if i < len(old) and len(old) == len(nb.cells) else None)
        if keep: c['id'] = keep
    nbformat.validator.normalize(nb)
    nbformat.write(nb, nb_path)

if __name__ == '__main__':
    cmd, src, dst = sys.argv[1:4]
    {'to-py': to_py, 'to-nb': to_nb}[cmd](src, dst)
