"""A run that goes on with changes on another number of processes, and a fork from one of its checkpoints: one real
run of two attempts (2 processes, then 1) and a fork of it (2 processes), a few steps each of an 80-conversation
epoch. (The allow-list, the refusals and what resume()/fork() write are checked without a launch in
nbs/61_session.ipynb; the plan across world sizes and a resume that lengthens a run in nbs/34_worker.ipynb.)"""
import json
from pathlib import Path

import pytest

from conftest import make_session, wait_until
from ilab_nb.rundir import RunPaths, standing_records
from ilab_nb.runstore import ProcessRef

pytestmark = pytest.mark.timeout(900)
LR, LINES = 1e-3, 80


def records(rd, kind=None):
    recs = [json.loads(l) for l in (Path(rd) / "metrics.jsonl").read_text().splitlines() if l.strip()]
    return [r for r in recs if kind is None or r["kind"] == kind]


def snapshot(rd) -> dict:
    return {str(f.relative_to(rd)): f.read_bytes() for f in sorted(Path(rd).rglob("*")) if f.is_file()}


def seen_by_step(rd) -> dict:
    "The data_seen probe's samples of every step, all attempts (each attempt's completed or stopped event)."
    out = {}
    for r in records(rd, "event"):
        if "data_seen" in r: out.update({int(k): v for k, v in r["data_seen"]["steps"].items()})
    return out


@pytest.mark.processes
def test_resume_longer_on_one_process_then_fork_on_two(demo, small_train, runs_root, tmp_path, monkeypatch):
    """Attempt 1: 2 processes, max_steps=2. Attempt 2: resume(num_processes=1, gradient_accumulation_steps=2,
    max_steps=-1): the same global batch on one process, to the end of the epoch. Then a fork from attempt 2's step-4
    checkpoint back on 2 processes x 1, beside attempt 2 from the same checkpoint."""
    monkeypatch.setenv("ILAB_NB_RECORD_DATA_SEEN", "1")          # the workers name the samples each step trained on
    data = tmp_path / "train.jsonl"
    data.write_text("".join(small_train.read_text().splitlines(keepends=True)[:LINES]))
    s = make_session(demo, data, runs_root, max_steps=2, save_steps=2, max_tokens_per_batch=512, learning_rate=LR)
    s.start()
    assert s.wait(timeout=300) == "completed", s.logs()
    s.resume(num_processes=1, gradient_accumulation_steps=2, max_steps=-1)
    assert s.wait(timeout=300) == "completed", s.logs()
    sup = ProcessRef.from_dict(s.state["supervisor"])             # after the state, its event, log line and reserve:
    wait_until(lambda: not sup.alive(), 60, what="the supervisor to end")   # the parent at rest before its snapshot
    parent = snapshot(s.run_dir)
    f = s.fork(step=4, num_processes=2, gradient_accumulation_steps=1)
    assert f.wait(timeout=300) == "completed", f.logs()
    assert snapshot(s.run_dir) == parent                        # the parent's files: not one byte changed

    # the run: continuous steps across the attempts, each attempt's header with its world size, changes and schedule
    heads = records(s.run_dir, "header")
    total = heads[-1]["total_steps"]
    assert [(h["attempt"], h["world_size"], h["total_steps"], h["resumed_from_step"]) for h in heads] == \
        [(1, 2, 2, None), (2, 1, total, 2)] and total > 5
    assert heads[1]["changes"] == {"num_processes": [2, 1], "gradient_accumulation_steps": [1, 2], "max_steps": [2, -1]}
    assert f"over {total} steps (was 2)" in heads[1]["schedule"]["note"], heads[1]["schedule"]
    train = [r for r in standing_records(records(s.run_dir)) if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, total + 1))
    totals = {1: 2, 2: total}
    for r in train:   # linear decay over the total of the attempt that ran the step: the schedule recomputed
        assert r["learning_rate"] == pytest.approx(LR * (totals[r["attempt"]] - r["step"]) / totals[r["attempt"]], abs=1e-12), r
    assert sorted(s.state["changes"]) == ["2"] and s.state["num_processes"] == 1
    assert json.loads((s.run_dir / "config.json").read_text())["max_steps"] == 2          # the run as started
    assert json.loads(RunPaths(s.run_dir).attempt_config(2).read_text())["num_processes"] == 1

    # 2 processes then 1: every sample of the epoch trained once; 2, 1 and (the fork) 2 again: the same
    n = heads[0]["num_train_samples"]
    steps, fsteps = seen_by_step(s.run_dir), seen_by_step(f.run_dir)
    assert sorted(steps) == list(range(1, total + 1)) and sorted(fsteps) == list(range(5, total + 1))
    assert sorted(i for v in steps.values() for i in v) == list(range(n))
    assert sorted([i for k in range(1, 5) for i in steps[k]] + [i for v in fsteps.values() for i in v]) == list(range(n))
    assert all(fsteps[k] == steps[k] for k in fsteps)          # each step: the same samples on 2 ranks as on 1 x 2

    # the fork: its own run from step 4, lineage named, on the same trajectory as its parent
    fh = records(f.run_dir, "header")
    assert len(fh) == 1 and (fh[0]["forked_from"]["run_id"], fh[0]["forked_from"]["step"]) == (s.run_id, 4)
    assert fh[0]["forked_from"]["changes"] == {"num_processes": [1, 2], "gradient_accumulation_steps": [2, 1]}
    assert (fh[0]["resumed_from_step"], fh[0]["world_size"], fh[0]["total_steps"]) == (4, 2, total)
    ft = {r["step"]: r["loss"] for r in records(f.run_dir, "train")}
    pt = {r["step"]: r["loss"] for r in train}
    assert sorted(ft) == list(range(5, total + 1))
    assert ft[5] == pytest.approx(pt[5], rel=1e-5)               # the fork's first step is the parent's step 5
    worst = max(abs(ft[k] - pt[k]) for k in ft)
    print(f"\n[measured] fork (2 processes x 1) vs parent (1 process x 2) from step 4, steps 5-{total}: "
          f"max |loss diff| {worst:.2e}")
    assert worst < 1e-3                                          # optimizer state and schedule came along
    runs = {r["run_id"]: r for r in type(s).list_runs(runs_root)}
    assert runs[f.run_id]["forked_from"] == f"{s.run_id}@4" and runs[s.run_id]["forked_from"] is None
    assert runs[s.run_id]["changed"] == {2: ["gradient_accumulation_steps", "max_steps", "num_processes"]}
