"""Shared fixtures and helpers: the demo assets (built once per test session), a slice of their training data, a fresh
runs root with its own device locks, the `ilab-nb` command line, the 2-rank CPU fields, the runs shared by several
tests (`demo_run`: the one run that proves learning; `tracked_run`: a finished FSDP run with trackers and samples),
a guard that no process of a test's runs outlives the test, and one that every test starting a process is marked
`processes` (`make test-fast` runs the others)."""
import gc, os, signal, subprocess, sys, time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]

# One math thread in every process of the suite, set before torch is imported: in the pytest workers, in the ranks (as
# the launcher gives them), and in every other process a test starts (the `ilab-nb demo` CLI, Jupyter kernels, exports,
# lm-eval). Two workers share two cores with the ranks they launch; a second OpenMP thread per process only spins
# waiting for a core: the in-process family runs took 52 CPU-s with two threads per process against 33 with one.
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:      # imported before this file (by a plugin): its thread pool is not started yet
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
TRAIN_LINES = 200   # a slice of the demo's training data keeps tokenization and start-up short

# The fields of a short 2-rank CPU run of the demo model (the tests add max_steps and what they check).
FIELDS = dict(num_processes=2, device="cpu", max_seq_len=256, max_tokens_per_batch=1024, logging_steps=1,
              learning_rate=1e-3)

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


# --- the `processes` marker: every test that starts a process carries it -------------------------------------------

SPAWN_EVENTS = frozenset({"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.system",
                          "os.exec"})
_current = {"nodeid": None}
_started: dict = {}      # nodeid -> what it started (the audit events' first argument)

# Tests in files this suite's maintainers do not edit here, known to start processes (their own marker is welcome).
PROCESSES_ELSEWHERE = {
    "tests/test_sizes.py::test_sharded_load_and_save_equal_the_whole_model_path",
    "tests/test_sizes.py::test_preflight_never_asks_torch_cuda_in_the_calling_process",
}


def _audit(event, args):
    if event in SPAWN_EVENTS and _current["nodeid"] is not None:
        _started.setdefault(_current["nodeid"], []).append(f"{event} {str(args[0] if args else '')[:80]}")


sys.addaudithook(_audit)      # observes only: every process still starts as it would


# --- the suite on both cores: tests sharing an expensive fixture run on one worker -------------------------------------

# `make test` runs the suite in two pytest-xdist workers (`-n 2 --dist loadgroup`), each with its own session and module
# fixtures. A test using one of these joins that fixture's group, and a group runs on one worker, so each is built once:
# the browser module's JupyterLab is shared by its dashboard and chat tests, and the chat test shares `demo_run` with
# the command line's; the SLURM and Ray clusters, the LoRA, DPO and GRPO modules' runs and test_sizes' model are per
# module.
SHARED_BY = {"demo_run": "demo_run", "lab": "demo_run", "tracked_run": "tracked_run", "cluster": "slurm",
             "lora_run": "lora_run", "dpo_run": "dpo_run", "tied_llama": "tied_llama", "families": "families",
             "grpo_run": "grpo_run", "ray_cluster": "ray", "agent_run": "agent_run"}


# --- the collector in a pytest worker: what collection imported is frozen --------------------------------------------

@pytest.hookimpl(wrapper=True)
def pytest_collection(session):
    """Collection imports torch, transformers, datasets, ray and Jupyter's libraries: about 500,000 objects that live
    to the end of the session. It runs with the collector off, as a rank's imports do (nbs/34_worker.ipynb): each of
    its full collections walked everything imported so far, a quarter of collection's CPU (one process collecting
    the suite: 10.1 CPU-s, 7.3 with the collector off). Then what it made is frozen (`gc.freeze`): the collections
    during the tests no longer walk it. Measured in one process, the collector's own CPU time (its `gc.callbacks`):
    the families' in-process runs and the DPO/TRL comparisons 5.27 -> 3.26 s, the modules that start no process
    2.29 -> 1.26 s."""
    gc.disable()
    try:
        return (yield)
    finally:
        gc.collect()
        gc.freeze()
        gc.enable()


@pytest.hookimpl(tryfirst=True)       # before pytest-xdist's own, which reads the groups
def pytest_collection_modifyitems(items):
    for item in items:
        if item.nodeid.split("[")[0] in PROCESSES_ELSEWHERE: item.add_marker(pytest.mark.processes)
        if group := next((g for f, g in SHARED_BY.items() if f in item.fixturenames), None):
            item.add_marker(pytest.mark.xdist_group(group))
    # the tests that start processes first, the quick in-process ones last: they fill both workers' last minutes
    items.sort(key=lambda item: item.get_closest_marker("processes") is None)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """pytest-xdist names a grouped test `nodeid@group`; under a pytest whose node ids it cannot rename (9.2) the test
    fails here, before its fixtures are built (an error in a worker's collection would not reach the terminal)."""
    grouped = getattr(item.config.option, "loadgroup", False) and item.get_closest_marker("xdist_group")
    if grouped and "@" not in item.nodeid:
        pytest.fail("pytest-xdist could not put this test in its group (this pytest no longer lets it rename tests), "
                    "so each worker would build the shared fixture: install pytest<9.2 (settings.ini)", pytrace=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current["nodeid"] = item.nodeid     # a session or module fixture set up for this test counts as this test's
    yield
    _current["nodeid"] = None


@pytest.fixture(autouse=True)
def processes_are_marked(request):
    "A test that started a process (or whose fixtures did) and is not marked `processes` fails, naming what it started."
    yield
    started = _started.pop(request.node.nodeid, [])
    if started and request.node.get_closest_marker("processes") is None:
        pytest.fail(f"{request.node.nodeid} started {len(started)} process(es) ({'; '.join(started[:3])}) but is not "
                    "marked `@pytest.mark.processes`: `make test-fast` (-m 'not processes') would run it", pytrace=False)


# --- the environment of every launch ---------------------------------------------------------------------------------

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


# --- comparisons with a tolerance -----------------------------------------------------------------------------------

def within(what: str, diff: float, tol: float, seen: str):
    """Asserts a measured difference is within its tolerance, and says both. `seen` is where the tolerance comes from:
    the difference measured when it was set, so a tolerance sits at least twice above it (`SEEN_MARGIN`). With
    ILAB_MEASURED=<file> set, each comparison appends {what, diff, tol} to it: the audit's figures for a whole run
    (`ILAB_MEASURED=/tmp/m.jsonl make pytest`)."""
    import json
    diff = float(diff)
    print(f"[measured] {what}: {diff:.3g} (tolerance {tol:.3g}; set from {seen})")
    if os.environ.get("ILAB_MEASURED"):
        with open(os.environ["ILAB_MEASURED"], "a") as f: f.write(json.dumps(dict(what=what, diff=diff, tol=tol)) + "\n")
    assert diff <= tol, f"{what}: {diff:.3g} > tolerance {tol:.3g} (set from {seen})"


def max_abs_diff(a, b) -> float:
    "The largest absolute difference of two tensors (or arrays) of one shape."
    import torch
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def rel_diff(got: float, want: float) -> float:
    "|got - want| / |want|."
    return abs(got - want) / abs(want)


def make_session(demo, data, runs_root, **kw):
    "A FineTuneSession of the demo model on `data` with FIELDS (overridden by `kw`), not started."
    from ilab_nb.session import FineTuneSession
    return FineTuneSession(demo.model_dir, data, runs_root=runs_root, **{**FIELDS, **kw})


def run_processes_under(root) -> list:
    "Live processes tagged (ILAB_NB_RUN_DIR) with a run directory under `root`."
    root, out = str(Path(root).absolute()), []
    for p in psutil.process_iter(["pid", "status"]):
        if p.pid == os.getpid() or p.info["status"] == psutil.STATUS_ZOMBIE: continue
        try:
            if p.environ().get("ILAB_NB_RUN_DIR", "").startswith(root + os.sep): out.append(p)
        except psutil.Error: pass
    return out


def rank_process(run_dir, rank):
    """The live process of `rank` of the run in `run_dir` while its account (`ranks/rank-N.json`, its pid) says it is
    running, else None. By its account, not its environment: a rank forked from its launcher (`ilab_nb.warm_launch`)
    has the launcher's command line, and its `RANK` is not in the environment `/proc` shows. Whether the pid is still
    that rank: the supervisor's own test (`diagnosis.rank_gone`)."""
    import json
    from ilab_nb.diagnosis import rank_gone
    from ilab_nb.rundir import RunPaths
    try:
        rec = json.loads(RunPaths(run_dir).rank_account(rank).read_text())
        return psutil.Process(rec["pid"]) if rec["status"] == "running" and not rank_gone(rec) else None
    except (OSError, ValueError, KeyError, psutil.Error): return None


def kill_processes_under(root):
    "SIGKILL every live process of the runs under `root` and reap what can be reaped."
    left = run_processes_under(root)
    for p in left:
        try: p.send_signal(signal.SIGKILL)
        except psutil.Error: pass
    psutil.wait_procs(left, timeout=10)


def runs_env(root: Path) -> dict:
    "The variables that give runs under `root` their own device locks and 2 CPU slots."
    return {"ILAB_NB_RUNS": str(root / "runs"), "ILAB_NB_LOCKS": str(root / "locks"), "ILAB_NB_CPU_SLOTS": "2"}


def train_here(s) -> str:
    "Make `s`'s run directory as `start()` does, without its supervisor, and train it here as rank 0 of 1: the outcome."
    from ilab_nb import worker
    from ilab_nb.rundir import RunPaths
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(s, "_spawn", lambda *a, **k: None)
        s.start()
    return worker.run(RunPaths(s.run_dir))


def fork_here(s, *args, **changes):
    """`s.fork(*args, **changes)` made as `fork()` makes it (preflight, run directory, the checkpoint linked in), without
    its supervisor, and trained here as rank 0 of 1 from that checkpoint, as `train_here` trains a new run: `(fork,
    outcome)`. Launched, a 1-process fork is the same `run()` behind a supervisor and `accelerate launch`, two more
    interpreters that import torch; a fork launched in the background is tests/test_lineage.py's and test_grpo's."""
    import torch.distributed as dist
    from ilab_nb import worker
    from ilab_nb.rundir import RunPaths
    from ilab_nb.session import FineTuneSession
    spawned = {}
    with pytest.MonkeyPatch.context() as mp:
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"): mp.delenv(k, raising=False)
        mp.setattr(FineTuneSession, "_spawn", lambda self, attempt, resume=None: spawned.update(a=attempt, r=resume))
        f = s.fork(*args, **changes)
        try: return f, worker.run(RunPaths(f.run_dir), resume=spawned["r"], attempt=spawned["a"])
        finally:
            if dist.is_available() and dist.is_initialized(): dist.destroy_process_group()


@pytest.fixture
def runs_root(tmp_path, monkeypatch):
    "A fresh runs root (and device-lock directory, and 2 CPU slots); every process of its runs is killed afterwards."
    for k, v in runs_env(tmp_path).items(): monkeypatch.setenv(k, v)
    yield tmp_path / "runs"
    kill_processes_under(tmp_path / "runs")


def wait_until(pred, timeout, poll=0.2, what="condition"):
    "Poll `pred()` until it returns something truthy; fail the test after `timeout` seconds."
    t0 = time.time()
    while time.time() - t0 < timeout:
        v = pred()
        if v: return v
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


# --- the command line ------------------------------------------------------------------------------------------------

CLI = [sys.executable, "-c", "from ilab_nb.cli import console; console()"]   # `ilab-nb`, this checkout


def cli_env(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), **extra}


def ilab(*args, timeout=200, check=None, env=None, **kw) -> subprocess.CompletedProcess:
    "Run `ilab-nb ARGS` in its own process and return the CompletedProcess; `check`: the exit code it must have."
    r = subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env or cli_env(), **kw)
    if check is not None: assert r.returncode == check, f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr[-3000:]}"
    return r


# --- runs shared by several tests ------------------------------------------------------------------------------------

DEMO_STEPS = 160   # enough for the demo model on one process to answer about 5 in 6 held-out questions (84 % measured)


@pytest.fixture(scope="session")
def demo_run(demo, tmp_path_factory):
    """`ilab-nb demo` run once per test session, for real (DEMO_STEPS steps on one CPU process): `(CompletedProcess,
    run_dir)`. The suite's one proof of learning: the CLI test reads what it printed; the browser test chats with its
    model. One process trains on half the demo's 2-process batch (half the CPU); that 2 processes step as one process
    with twice the accumulation does is tests/test_lineage.py's and bench/bench_resume.py's check."""
    tmp = tmp_path_factory.mktemp("demo-run")
    r = ilab("demo", "--path", demo.root, "--runs-root", tmp / "runs", "--eval-limit", "40", f"max_steps={DEMO_STEPS}",
             "num_processes=1", timeout=600, env=cli_env(**runs_env(tmp)))
    (REPO / "artifacts").mkdir(exist_ok=True)
    (REPO / "artifacts" / "demo_run.txt").write_text(r.stdout)      # git-ignored: its figures, for inspection
    runs = sorted((tmp / "runs").iterdir()) if (tmp / "runs").exists() else []
    assert r.returncode == 0 and len(runs) == 1, f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr[-3000:]}"
    return r, runs[0]


PROMPTS = ["What is the capital of Nutoland?", [{"role": "system", "content": "Answer in one word."},
                                                 {"role": "user", "content": "What money do people use in Tarbristan?"}]]


LONG_ROW = {"messages": [{"role": "user", "content": "Tell me everything."},
                         {"role": "assistant", "content": " ".join(["word"] * 700)}]}   # over max_seq_len: dropped
EVAL_ROWS = 20


@pytest.fixture(scope="session")
def tracked_run(demo, small_train, tmp_path_factory):
    """One finished 2-rank FSDP run with eval prompts (PROMPTS), evaluations every 2 steps, TensorBoard, MLflow, W&B
    (offline) and trackio (local),
    trained from a pandas DataFrame (small_train's rows and LONG_ROW) with eval_data a list of EVAL_ROWS held-out
    rows: the trackers', the samples', the chat's, the schema's and the in-memory data's tests read it."""
    import pandas as pd
    from ilab_nb.data import load_chat_records
    root = tmp_path_factory.mktemp("tracked")
    mp = pytest.MonkeyPatch()
    for k, v in runs_env(root).items(): mp.setenv(k, v)
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    mp.setenv("WANDB_MODE", "offline"); mp.setenv("WANDB_SILENT", "true"); mp.delenv("WANDB_DIR", raising=False)
    mp.delenv("TRACKIO_DIR", raising=False); mp.delenv("TRACKIO_SPACE_ID", raising=False)
    try:
        df = pd.DataFrame([{"messages": r["messages"]} for r in load_chat_records(small_train)] + [LONG_ROW])
        evals = [{"messages": r["messages"]} for r in load_chat_records(demo.eval_file)[:EVAL_ROWS]]
        s = make_session(demo, df, root / "runs", eval_data=evals, max_steps=4, eval_steps=2, eval_prompts=PROMPTS,
                         eval_max_new_tokens=6, report_to=["tensorboard", "mlflow", "wandb", "trackio"])
        s.start()
        del df, evals                                           # the run does not need the objects any more
        assert s.wait(timeout=300) == "completed", s.logs()
    finally:
        mp.undo()
        kill_processes_under(root / "runs")
    return s
