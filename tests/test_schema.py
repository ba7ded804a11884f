"""Every record a real run writes matches `ilab_nb.rundir.SCHEMA`, and ARCHITECTURE.md's schema section is that table."""
import json, subprocess, sys
from pathlib import Path

import pytest

from ilab_nb.rundir import SCHEMA, RunPaths, schema_problems

pytestmark = pytest.mark.timeout(900)   # a loaded machine is slow; no assertion is on time
REPO = Path(__file__).resolve().parents[1]


def problems_in(run_dir) -> list:
    "Every schema problem of every record in the run directory, each prefixed with the file (and line) it came from."
    p, out, kinds = RunPaths(run_dir), [], set()
    for i, line in enumerate(p.metrics.read_text().splitlines(), 1):
        rec = json.loads(line); kind = rec.get("kind"); kinds.add(kind)
        if kind not in SCHEMA or SCHEMA[kind]["file"] != "metrics.jsonl":
            out.append(f"metrics.jsonl:{i}: kind {kind!r} is not in ilab_nb.rundir.SCHEMA: add it there (nbs/11_rundir.ipynb)")
        else: out += [f"metrics.jsonl:{i}: {m}" for m in schema_problems(rec, kind)]
    for i, line in enumerate(p.events.read_text().splitlines(), 1):
        out += [f"events.jsonl:{i}: {m}" for m in schema_problems(json.loads(line), "lifecycle")]
    out += [f"state.json: {m}" for m in schema_problems(json.loads(p.state.read_text()), "state")]
    for f in sorted(p.ranks.glob("rank-*.json")):
        out += [f"ranks/{f.name}: {m}" for m in schema_problems(json.loads(f.read_text()), "rank")]
    return out, kinds


@pytest.mark.processes
def test_every_record_of_a_real_run_matches_the_schema(tracked_run):
    "conftest's `tracked_run`: 2 ranks, FSDP, evaluations with sample answers, checkpoints, trackers, to the end."
    found, kinds = problems_in(tracked_run.run_dir)
    assert not found, "\n".join(found)
    assert kinds == {"header", "train", "eval", "samples", "event"}
    assert sorted(f.name for f in RunPaths(tracked_run.run_dir).ranks.glob("rank-*.json")) == ["rank-0.json", "rank-1.json"]


def test_an_unknown_field_is_a_failure_saying_where_to_add_it(tmp_path):
    run = RunPaths(tmp_path / "r"); run.ranks.mkdir(parents=True)
    run.metrics.write_text(json.dumps(dict(schema=1, kind="eval", run_id="r", attempt=1, time=0.0, step=1, epoch=0.1,
                                           eval_loss=1.0, eval_tokens=5, eval_ppl=2.7)) + "\n"
                           + json.dumps(dict(schema=1, kind="activations", run_id="r", attempt=1, time=0.0)) + "\n")
    run.events.write_text(json.dumps(dict(time=0.0, event="created")) + "\n")
    run.state.write_text(json.dumps(dict(status="queued", attempt=1, run_id="r", created_at=0.0, updated_at=0.0)))
    found, _ = problems_in(run.root)
    assert len(found) == 2 and found[0].startswith("metrics.jsonl:1: eval record has field 'eval_ppl'"), found
    assert all("nbs/11_rundir.ipynb" in m for m in found) and found[1].startswith("metrics.jsonl:2: kind 'activations'")


@pytest.mark.processes
def test_architecture_md_schema_section_is_generated_from_the_table():
    r = subprocess.run([sys.executable, str(REPO / "tools" / "schema_doc.py"), "--check"], capture_output=True, text=True,
                       env={"PYTHONPATH": str(REPO), "PATH": ""})
    assert r.returncode == 0, r.stderr
    sys.path.insert(0, str(REPO / "tools"))
    import schema_doc
    text = (REPO / "ARCHITECTURE.md").read_text()
    assert schema_doc.render(text.replace("`eval_tokens` int", "`eval_tokens` str")) == text   # an edit by hand is undone
