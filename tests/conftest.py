"""Shared fixtures: the demo assets (built once per test session), a fresh runs root with its own device locks,
and a guard that no process of a test's runs outlives the test."""
import os, signal, time
from pathlib import Path

import psutil
import pytest

TRAIN_LINES = 200   # a slice of the demo's training data keeps tokenization and start-up short

# A user's accelerate default config that would change every launch if `accelerate launch` read it: GPU ids that
# override CUDA_VISIBLE_DEVICES (and refuse --multi_gpu with fewer than two), DeepSpeed for one-process launches,
# fp16, four processes, inductor. Every launch of the suite runs under it (HF_HOME points at it), so every run that
# does what its config says shows the launch depends on no default config.
HOSTILE_ACCELERATE_DEFAULT = """\
compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
gpu_ids: '1'
mixed_precision: fp16
num_processes: 4
num_machines: 1
use_cpu: false
debug: false
dynamo_config:
  dynamo_backend: INDUCTOR
deepspeed_config:
  zero_stage: 3
"""


@pytest.fixture(scope="session", autouse=True)
def hostile_accelerate_default(tmp_path_factory):
    "HF_HOME with the hostile `accelerate/default_config.yaml` above, for every process the suite starts."
    home = tmp_path_factory.mktemp("hf_home")
    (home / "accelerate").mkdir()
    (home / "accelerate" / "default_config.yaml").write_text(HOSTILE_ACCELERATE_DEFAULT)
    old = os.environ.get("HF_HOME")
    os.environ["HF_HOME"] = str(home)
    yield home
    if old is None: os.environ.pop("HF_HOME", None)
    else: os.environ["HF_HOME"] = old


@pytest.fixture(scope="session")
def demo(tmp_path_factory):
    "The demo assets (tiny model, tokenizer, chat data) built once per test session in a temporary directory."
    from ilab_nb.demo import demo_assets
    return demo_assets(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="session")
def small_train(demo, tmp_path_factory):
    "The first TRAIN_LINES conversations of the demo's training data."
    p = tmp_path_factory.mktemp("data") / "train.jsonl"
    with open(demo.train_file) as f: lines = [next(f) for _ in range(TRAIN_LINES)]
    p.write_text("".join(lines))
    return p


def run_processes_under(root) -> list:
    "Live processes tagged (ILAB_NB_RUN_DIR) with a run directory under `root`."
    root, out = str(Path(root).absolute()), []
    for p in psutil.process_iter(["pid", "status"]):
        if p.pid == os.getpid() or p.info["status"] == psutil.STATUS_ZOMBIE: continue
        try:
            if p.environ().get("ILAB_NB_RUN_DIR", "").startswith(root + os.sep): out.append(p)
        except psutil.Error: pass
    return out


@pytest.fixture
def runs_root(tmp_path, monkeypatch):
    "A fresh runs root (and device-lock directory, and 2 CPU slots); every process of its runs is killed afterwards."
    root = tmp_path / "runs"
    monkeypatch.setenv("ILAB_NB_RUNS", str(root))
    monkeypatch.setenv("ILAB_NB_LOCKS", str(tmp_path / "locks"))
    monkeypatch.setenv("ILAB_NB_CPU_SLOTS", "2")
    yield root
    left = run_processes_under(root)
    for p in left:
        try: p.send_signal(signal.SIGKILL)
        except psutil.Error: pass
    psutil.wait_procs(left, timeout=10)


def wait_until(pred, timeout, poll=0.2, what="condition"):
    "Poll `pred()` until it returns something truthy; fail the test after `timeout` seconds."
    t0 = time.time()
    while time.time() - t0 < timeout:
        v = pred()
        if v: return v
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


DEMO_STEPS = 160   # enough for the demo model to answer about 9 in 10 held-out questions (91 % measured)


@pytest.fixture(scope="session")
def demo_run(demo, tmp_path_factory):
    """`ilab-nb demo` run once per test session, for real (2 CPU ranks, DEMO_STEPS steps): `(CompletedProcess, run_dir)`.
    The CLI test reads what it printed; the browser test chats with the model it trained."""
    import subprocess, sys
    tmp = tmp_path_factory.mktemp("demo-run")
    env = {**os.environ, "ILAB_NB_RUNS": str(tmp / "runs"), "ILAB_NB_LOCKS": str(tmp / "locks"), "ILAB_NB_CPU_SLOTS": "2",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    cmd = [sys.executable, "-c", "import sys; from ilab_nb.cli import main; sys.exit(main())", "demo", "--path", str(demo.root),
           "--runs-root", str(tmp / "runs"), "--eval-limit", "40", f"max_steps={DEMO_STEPS}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    runs = sorted((tmp / "runs").iterdir()) if (tmp / "runs").exists() else []
    assert r.returncode == 0 and len(runs) == 1, f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr[-3000:]}"
    return r, runs[0]
