"""Issue 7, faults of the run directory itself, with real processes: a full disk mid-run (a real small tmpfs as the
runs root; filled during a checkpoint, while only metrics are written, and while the final model is written), an unreadable `state.json`, a run directory deleted while its ranks train, a run id with a trailing
newline, and the message of a forced `stop()`; and faults planted in the real worker (tests/fault_worker.py): rank 0's
own error, and a rank that exits 0 before it finished. (A `state.json` corrupted while its run trains and as it ends:
tests/test_session.py::test_queue_and_stop_with_a_corrupt_state.)"""
import errno, os, shutil, signal, subprocess
from pathlib import Path

import pytest

from ilab_nb.slots import DeviceSlots
from ilab_nb.runstore import ProcessRef, RunStore, RUN_ENV, run_processes, validate_run_id
from ilab_nb.session import FineTuneSession
import ilab_nb.session as session_mod
from conftest import ilab, kill_processes_under, make_session, wait_until

pytestmark = pytest.mark.timeout(1200)   # generous: a loaded 2-core machine starts ranks slowly

START_UP = 300         # s allowed from start() to the first metric (a loaded 2-core machine)
LONG = 1000            # steps of a run that never finishes here (a step is ~1 CPU-s: it outlasts every test here)


def make(demo, small_train, runs_root, **kw):
    return make_session(demo, small_train, runs_root, **kw)


def cli(*args, runs_root):
    "The `ilab-nb` command line in its own process: (return code, stdout + stderr)."
    p = ilab(*args, "--runs-root", runs_root, timeout=120)
    return p.returncode, p.stdout + p.stderr


def row(out, run_id):
    return next(l for l in out.splitlines() if l.startswith(run_id))


def running(s):
    "Wait until the run's ranks train (the worker's header is in; the supervisor said `running`)."
    return wait_until(lambda: s.status == "running", START_UP, what=f"run {s.run_id} running")


def rmtree_while_written(d):
    "shutil.rmtree of a directory others write into (a file created meanwhile makes one pass fail: go again)."
    def gone():
        try: shutil.rmtree(d)
        except FileNotFoundError: pass
        except OSError: return False
        return not d.exists()
    wait_until(gone, 30, poll=0.05, what=f"{d} removed")


def test_run_id_with_a_trailing_newline_is_refused(demo, small_train, runs_root):
    for bad in ("x\n", "x\n\n"):
        with pytest.raises(ValueError, match="Invalid run id"): validate_run_id(bad)
        with pytest.raises(ValueError, match="Invalid run id"): make(demo, small_train, runs_root, run_id=bad)
    assert not runs_root.exists() or list(runs_root.iterdir()) == []
    (runs_root / "x\n").mkdir(parents=True)             # made by hand: not a run, never a broken `ls` row
    assert RunStore(runs_root).list_runs() == []


@pytest.mark.processes
def test_stop_on_the_default_path_says_how_long_it_waited(runs_root, monkeypatch):
    # A run whose supervisor (a live process of ours, tagged with the run) never answers the stop request.
    # It is a child of a shell, not of this process: stop() reaps what it kills (psutil.wait_procs), and a child of ours
    # reaped there would leave Popen.wait nothing but ECHILD (returncode 0). The shell reports how its child ended.
    store = RunStore(runs_root); rid = "deaf"; d = store.create_run(rid)
    shell = subprocess.Popen(["sh", "-c", f'{RUN_ENV}="$0" sleep 120 & echo $!; wait $!; echo $?', str(d)],
                             stdout=subprocess.PIPE, text=True, env={k: v for k, v in os.environ.items() if k != RUN_ENV})
    deaf = int(shell.stdout.readline())
    import time
    store.write_state(rid, status="running", supervisor=ProcessRef.of(deaf).to_dict(), heartbeat_at=time.time())
    monkeypatch.setattr(session_mod, "TERM_GRACE_S", -28)    # the default wait: grace 0 + (-28) + 30 = 2 s
    s = FineTuneSession.attach(rid, runs_root=runs_root)
    assert s.stop(grace_s=0) == "cancelled"                  # timeout=None: the default path
    assert "nothing had ended 2 s after the request" in s.reason and "None" not in s.reason, s.reason
    assert shell.communicate(timeout=10)[0].strip() == str(128 + signal.SIGKILL)     # the shell's $? for a child killed by SIGKILL


@pytest.mark.processes
def test_unreadable_state_and_a_run_dir_without_state_are_listed(runs_root):
    store = RunStore(runs_root); store.create_run("broken"); store.create_run("bare")
    store.write_state("broken", status="queued", attempt=1)
    for f in ("state.json", "state.json.prev"): (store.run_dir("broken") / f).write_text('{"status": "run')
    rc, out = cli("ls", runs_root=runs_root)
    assert rc == 0 and "state unreadable" in row(out, "broken") and "incomplete" in row(out, "bare"), out
    rc, out = cli("status", "broken", runs_root=runs_root)
    assert rc == 0 and "status:   state unreadable" in out, out
    s = FineTuneSession.attach("broken", runs_root=runs_root)
    assert s.status == "unreadable"
    with pytest.raises(RuntimeError, match="unreadable"): s.wait(timeout=30)


@pytest.mark.processes
def test_deleted_run_dir_frees_its_devices_for_a_run_whose_rank_0s_own_error_is_the_cause(demo, small_train, runs_root,
                                                                                         monkeypatch):
    # Item 3: a run whose directory is deleted while it trains (one rank, on one CPU slot: the supervisor ends the
    # process group whatever its size).
    b = make(demo, small_train, runs_root, max_steps=LONG, num_processes=1).start()
    running(b)
    sup = ProcessRef.from_dict(b.state["supervisor"])
    ranks = [p for p in run_processes(b.run_dir) if p.pid != sup.pid]
    assert ranks
    rmtree_while_written(b.run_dir)
    wait_until(lambda: not run_processes(b.run_dir) and not sup.alive(), 60, what="every process of the deleted run to end")
    assert not b.run_dir.exists()                          # nothing re-created it; nothing of it is left to do so
    assert all(DeviceSlots().holder(f"cpu-{i}") is None for i in range(2))

    # Its CPU slot is free at once: a 2-process run that refuses to queue starts and gets cpu-0 and cpu-1.
    # (Item 2, a state.json corrupted under a running run: tests/test_session.py::test_queue_and_stop_with_a_corrupt_state.)
    # That run is the next fault's (one launch for both; a forced stop right after a start is test_session's
    # test_two_starts_at_once_on_the_same_devices_one_runs): rank 0 fails on its own (its tracker cannot be opened);
    # torchrun then ends rank 1, which waited for it, with SIGTERM and lists it as killed by a signal. The cause is
    # rank 0, with its own error.
    from functools import partial
    tests = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", tests + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setattr(session_mod, "spawn_supervisor", partial(session_mod.spawn_supervisor, worker_module="fault_worker"))
    s = make(demo, small_train, runs_root, max_steps=2, queue=False).start()
    wait_until(lambda: s.state.get("slots"), 60, what="the run to get its devices")
    assert sorted(s.state["slots"]) == ["cpu-0", "cpu-1"]
    assert s.wait(timeout=START_UP) == "failed"
    log = (s.run_dir / "logs" / "supervisor.log").read_text()
    assert "exitcode  : -15" in log, log[-3000:]                  # torchrun did list rank 1 as killed by SIGTERM
    assert s.state["failed_rank"] == 0, s.reason
    assert ("rank 0 exited with code 1; FileNotFoundError: [Errno 2] No such file or directory: "
            "'/nonexistent/mlruns/0/meta.yaml'; then the launcher ended the others (rank 1 was killed by signal SIGTERM)"
            in s.reason), s.reason
    assert s.state["log_file"] == "logs/rank-0.log"
    wait_until(lambda: not run_processes(s.run_dir), 30, what="the run's processes to end")


@pytest.fixture
def tmpfs_runs_root(runs_root):
    "The runs root on a real 96 MiB tmpfs (needs root); every process of its runs is killed before it is unmounted."
    if os.geteuid() != 0: pytest.skip("mounting a small tmpfs to fill up needs root")
    runs_root.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96m", "tmpfs", str(runs_root)], capture_output=True, text=True)
    if r.returncode != 0: pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try: yield runs_root
    finally:
        kill_processes_under(runs_root)
        if subprocess.run(["umount", str(runs_root)]).returncode != 0: subprocess.run(["umount", "-l", str(runs_root)])


def fill(path) -> int:
    "Write `path` until the file system is full; returns the open descriptor (close and unlink it to free the space)."
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    for chunk in (1 << 20, 4096):
        while True:
            try: os.write(fd, b"\0" * chunk)
            except OSError as e:
                assert e.errno == errno.ENOSPC; break
    return fd


def files_of(d): return {str(p.relative_to(d)): p.stat().st_size for p in sorted(d.rglob("*")) if p.is_file()}


def disk_full_ending(s, root, *what):
    """The run fails on the full disk within a minute, naming one of `what` (the file or directory it was writing), and
    every observer reads it so; the disk stays full."""
    t = wait_until(lambda: s.status == "failed" and s.state, 60 + 30, what=f"the run to fail on the full disk ({what})")
    said = [f"No space left on device while writing {w}" for w in what]
    assert any(x in s.reason for x in said), s.reason
    assert t["ended_at"] - os.stat(root / "filler").st_mtime < 60, (t["ended_at"], s.reason)
    assert s.wait(timeout=5) == "failed"
    rc, out = cli("status", s.run_id, runs_root=root)
    assert rc == 0 and any(x in out for x in said), out
    wait_until(lambda: not run_processes(s.run_dir), 60, what="every process of the run to end")
    assert [e["event"] for e in s.store.events(s.run_id)][-1] == "failed"


@pytest.mark.processes
def test_disk_full_during_a_checkpoint_then_while_writing_the_final_model(demo, small_train, tmpfs_runs_root):
    # Issue 20, item 5: the disk fills during a checkpoint save of a 2-rank FSDP run (torch's CheckpointException on
    # both ranks) and stays full: the run ends `failed`, saying so, within a minute, with the disk still full.
    root = tmpfs_runs_root
    s = make(demo, small_train, root, max_steps=LONG, save_steps=2, save_total_limit=3).start()   # the preflight's estimate fits
    ck = Path(wait_until(lambda: s.checkpoints, 2 * START_UP, what="a complete checkpoint")[0]["path"])
    before = files_of(ck)
    sup = ProcessRef.from_dict(s.state["supervisor"])
    fd = fill(root / "filler")
    os.ftruncate(fd, os.fstat(fd).st_size - (512 << 10))     # room for metrics lines, none for the next checkpoint
    try:
        disk_full_ending(s, root, "checkpoints/step-")
        rc, out = cli("ls", runs_root=root)
        assert rc == 0 and "failed" in row(out, s.run_id), out
        wait_until(lambda: not sup.alive(), 60, what="the supervisor to end")
    finally:
        os.close(fd); (root / "filler").unlink()
    assert files_of(ck) == before and (ck / "COMPLETE").exists()      # the complete checkpoint is untouched
    assert [c["path"] for c in s.checkpoints] == [str(ck)] or all((Path(c["path"]) / "COMPLETE").exists() for c in s.checkpoints)
    assert not list(s.run_dir.glob(".*.tmp")) and not list(s.run_dir.glob("*.tmp"))
    assert not [p for p in (s.run_dir / "checkpoints").iterdir() if p.name.startswith(".")]   # no half-written save kept

    # Space freed, the failed run is resumed for 2 more steps; once the resume has passed its preflight, the disk fills
    # again (another writer) up to room for one more checkpoint and not for final/: the last checkpoint is saved, the
    # final model is not; the run ends failed naming final/, its checkpoints intact.
    last = s.checkpoints[-1]; size = sum(files_of(Path(last["path"])).values())
    s.resume(max_steps=last["step"] + 2)
    fd = fill(root / "filler")
    os.ftruncate(fd, os.fstat(fd).st_size - size - (2 << 20))   # one checkpoint, the reserves and metrics: not final/
    try: disk_full_ending(s, root, "final/")
    finally: os.close(fd); (root / "filler").unlink()
    assert not (s.run_dir / "final").exists() and not (s.run_dir / ".tmp-final").exists()   # no half-written model kept
    assert s.checkpoints[-1]["step"] == last["step"] + 2 and all((Path(c["path"]) / "COMPLETE").exists() for c in s.checkpoints)


@pytest.mark.processes
def test_disk_full_while_writing_metrics(demo, small_train, tmpfs_runs_root):
    # Issue 20, item 5: the disk fills while the run trains and writes only its metrics (no checkpoint is due): rank 0's
    # next record cannot be written, to metrics.jsonl or as its line in the rank's log (whichever file needs a new
    # block first); the run ends failed naming that file, its final state written from the supervisor's reserve.
    root = tmpfs_runs_root
    s = make(demo, small_train, root, max_steps=LONG, num_processes=1).start()     # rank 0's records: one rank is enough
    wait_until(lambda: s.progress()["step"], START_UP, what="a logged step")
    fd = fill(root / "filler")
    try: disk_full_ending(s, root, "metrics.jsonl", "logs/rank-0.log")
    finally: os.close(fd); (root / "filler").unlink()
    s.monitor.poll(); assert s.monitor.train_records          # what was written before still reads


@pytest.mark.processes
def test_a_rank_that_exits_0_before_it_finished_fails_the_run(demo, small_train, runs_root, monkeypatch):
    # User code ends the one rank with os._exit(0) as its first step begins (tests/fault_worker.py, FAULT_WORKER=exit0):
    # exit code 0, but no account of finishing and no final/. The run failed, naming the rank, the step and its log.
    from functools import partial
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("FAULT_WORKER", "exit0")
    monkeypatch.setattr(session_mod, "spawn_supervisor", partial(session_mod.spawn_supervisor, worker_module="fault_worker"))
    s = make(demo, small_train, runs_root, num_processes=1, strategy="single", max_steps=2).start()
    assert s.wait(timeout=START_UP) == "failed"
    log = s.run_dir / "logs" / "rank-0.log"
    assert s.reason == (f"Run {s.run_id} failed: rank 0 exited with code 0 at step 0 of 2 before it finished (it wrote "
                        f"no account of finishing; final/ is missing). See {log}."), s.reason
    assert (s.state["failed_rank"], s.state["exit_code"], s.state["log_file"]) == (0, 0, "logs/rank-0.log"), s.state
    assert s.state["log_tail"] and s.state["log_tail"] == log.read_text().splitlines()[-20:], s.state["log_tail"]
    assert not (s.run_dir / "final").exists()
