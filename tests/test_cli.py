"""The `ilab-nb` command line, run as real subprocesses against real runs of the demo model (one CPU process: what
the commands do does not depend on the number of ranks; 2-rank runs are watched by the session and SLURM tests)."""
import json, re, subprocess, threading
from pathlib import Path

import pytest
import yaml

from ilab_nb.slots import DeviceSlots, device_request
from ilab_nb.runstore import RunStore, run_processes
from conftest import CLI, DEMO_STEPS, cli_env, ilab, wait_until

pytestmark = [pytest.mark.timeout(400), pytest.mark.processes]


@pytest.fixture
def config_file(demo, small_train, tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text(yaml.safe_dump({"model": str(demo.model_dir), "data": [str(small_train)], "num_processes": 1, "device": "cpu",
                                 "max_seq_len": 256, "max_tokens_per_batch": 1024, "learning_rate": 1e-3}))
    return p


STEP = re.compile(r"^step \d+/300 epoch ", re.M)


class Follower:
    "`ilab-nb logs ARGS` in its own process, its output collected as it comes."
    def __init__(self, *args):
        self.p = subprocess.Popen([*CLI, "logs", *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                  text=True, env=cli_env())
        self.lines = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.p.stdout: self.lines.append(line)

    def text(self) -> str: return "".join(self.lines)

    def wait_for_a_step(self):
        "Until it has printed a training line: stopped after that, the run's stop comes after a step in what it shows."
        wait_until(lambda: STEP.search(self.text()), 150, poll=0.5, what="logs -f to print a training step")

    def ended(self, timeout=30) -> str:
        "Its whole output once it has ended by itself (`-f` ends with the run)."
        self.p.wait(timeout=timeout); self.close()
        return self.text()

    def close(self):
        self.p.kill(); self.p.wait(); self.reader.join(timeout=10)


def test_run_in_background_then_ls_status_logs_stop_resume_watch(config_file, runs_root):
    held = DeviceSlots()                     # the fixture's own device locks: both CPU slots, so the run waits in the queue
    assert held.try_acquire("this-test", device_request("cpu", 2))
    follower = None
    try:
        r = ilab("run", config_file, "--runs-root", runs_root, "--name", "cli", "max_steps=300", check=0)
        run_id = r.stdout.split()[0]
        assert run_id.endswith("-cli") and (runs_root / run_id / "config.json").exists()
        assert json.loads((runs_root / run_id / "config.json").read_text())["max_steps"] == 300   # the override was honoured
        follower = Follower(run_id, "-f", "-n", "5", "--runs-root", runs_root)   # of the queued run
        wait_until(lambda: "queued for 1 of" in follower.text(), 60, what="logs -f showing the run queued")
        held.release()                       # the run's turn
        # (waited for in this process: a command-line process a second would slow the ranks' start on 2 cores)
        wait_until(lambda: RunStore(runs_root).read_state(run_id)["status"] == "running", 150, poll=1, what="running")
        assert "running" in ilab("status", run_id, "--runs-root", runs_root, check=0).stdout
        out = ilab("ls", "--runs-root", runs_root, check=0).stdout
        assert run_id in out and "running" in out
        follower.wait_for_a_step()
        out = ilab("stop", run_id, "--runs-root", runs_root, check=0).stdout          # from another process
        assert out.strip() == f"{run_id}: cancelled"
        followed = follower.ended()
    finally:
        held.release()
        if follower: follower.close()
    assert followed.index("queued for 1 of") < followed.index("launching: ")
    assert_followed(followed, run_id, 1)
    assert not run_processes(runs_root / run_id)
    st = ilab("status", run_id, "--runs-root", runs_root, "--json", check=0).stdout
    assert json.loads(st)["status"] == "cancelled"
    assert "rank" in ilab("logs", run_id, "-n", "3", "--runs-root", runs_root, check=0).stdout

    out = ilab("resume", run_id, "--runs-root", runs_root, check=0).stdout
    assert "attempt 2" in out
    follower = Follower(run_id, "-f", "-n", "0", "--runs-root", runs_root)        # attempt 2, from queued
    try:
        wait_until(lambda: RunStore(runs_root).read_state(run_id)["status"] == "running", 150, poll=1, what="attempt 2 running")
        follower.wait_for_a_step()
        ilab("stop", run_id, "--no-wait", "--runs-root", runs_root, check=0)
        w = ilab("watch", run_id, "--runs-root", runs_root, check=1)                      # ends cancelled: exit 1
        followed = follower.ended()
    finally:
        follower.close()
    assert "cancelled" in w.stdout and "attempt 2" in w.stdout
    assert_followed(followed, run_id, 2)
    assert not run_processes(runs_root / run_id)
    assert ">cancelled</span>" in (runs_root / run_id / "report.html").read_text()     # its supervisor's, as it ended
    out = ilab("report", run_id, "--runs-root", runs_root, check=0).stdout.strip()           # written again, on request
    assert out == str(runs_root / run_id / "report.html") and "attempt 2" in Path(out).read_text()


def assert_followed(followed, run_id, attempt):
    "Issue 20 item 6: `logs -f` of a queued run shows the supervisor's lines, then rank 0's training lines, then the ending."
    launch, step = followed.find("launching: "), STEP.search(followed)
    assert step, followed[-3000:]                                    # was: only the supervisor's log, never a step
    if attempt == 1: assert 0 <= launch < step.start(), followed[-3000:]   # (attempt 2's launch may precede the follower)
    assert followed.index("stop requested by") > step.start(), followed[-3000:]
    assert followed.rstrip().splitlines()[-1].startswith(f"--- run {run_id} cancelled (attempt {attempt})"), followed[-3000:]


def test_the_commands_on_runs_import_neither_torch_nor_datasets(runs_root):
    """`ls`, `status`, `logs`, `stop`, `report` read and write files only: the command line and FineTuneSession's module
    load without torch, transformers or datasets (each seconds to import), which only a launch, a load or a chat needs."""
    code = ("import sys, ilab_nb.cli, ilab_nb.session; ilab_nb.cli.main(['ls', '--runs-root', sys.argv[1]]); "
            "print(sorted(m for m in ('torch', 'transformers', 'datasets', 'pandas') if m in sys.modules))")
    r = subprocess.run([CLI[0], "-c", code, str(runs_root)], capture_output=True, text=True, timeout=60, env=cli_env())
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout


def test_bad_input_exits_2_with_the_reason(config_file, runs_root):
    r = ilab("run", config_file, "--runs-root", runs_root, "learning_rat=1e-4", check=2)
    assert "learning_rate" in r.stderr and not runs_root.exists()
    r = ilab("resume", "no-such-run", "--runs-root", runs_root, check=2)
    assert "No run 'no-such-run'" in r.stderr
    r = ilab("run", config_file, "--runs-root", runs_root, "max_steps", check=2)
    assert "key=value" in r.stderr


def test_demo_prints_before_and_after(demo_run):
    r, run_dir = demo_run
    out = r.stdout
    for what in ("before: held-out accuracy", f"after {DEMO_STEPS} steps", "training loss:", "held-out loss:",
                 "held-out accuracy:", "throughput:", "token efficiency:"):
        assert what in out, out
    first, last = map(float, re.search(r"training loss:\s+([\d.]+) -> ([\d.]+)", out).groups())
    assert last < first, out                                     # the loss fell
    before, after = map(float, re.search(r"held-out accuracy:\s+([\d.]+) ?% -> ([\d.]+) ?%", out).groups())
    assert before < 10 and after >= 80, out                      # it learned the atlas (84 % measured: 160 steps, 1 process)
    assert RunStore(run_dir.parent).read_state(run_dir.name)["status"] == "completed"
