"""Issue 55, with real processes: a pruning search (66_search) started by a kernel that is then killed, its driver
killed too and a new one started by another process, then extended. Every trial is an ordinary one-process run of the
demo model; the pruned one ends `pruned` with its checkpoint kept. Two short runs and two drivers in all: the trial added
by `extend` is refused by its preflight (a trial that cannot start fails, the search goes on), and the command line is
called in this process, as its own notebook calls it."""
import contextlib, io, json, subprocess, sys, textwrap

import optuna
import pytest

from ilab_nb.runstore import ProcessRef, RunStore
from ilab_nb.search import Search
from ilab_nb.session import FineTuneSession
from ilab_nb.cli import main as cli
from conftest import wait_until

pytestmark = pytest.mark.timeout(400)

# The kernel: it starts the search and would go on working; the test kills it. Trial 0 learns at 3e-3 for 10 steps,
# trial 1 at 1e-6 for 2,000 (trial 2, added by extend, asks for a negative learning rate: refused before it runs):
# after trial 0 has completed, trial 1's first evaluation is worse than trial 0's at that step, so the median rule
# (n_startup_trials=1) prunes it there. The pruner is of the kernel's own class, so it prunes from a child of the
# driver (66_search's `GatedPruner`). Its 2,000 steps (minutes) leave the
# driver, however loaded the machine, far more time than it needs to see that evaluation before the run could end.
KERNEL = textwrap.dedent("""
    import sys, time, optuna
    from ilab_nb import FineTuneSession
    model, data, root = sys.argv[1:4]
    def space(trial): return {"learning_rate": [3e-3, 1e-6, -1.0][trial.number % 3],
                              "max_steps": [10, 2000, 10][trial.number % 3]}
    class Median(optuna.pruners.MedianPruner):
        "The kernel's own class (Optuna's median rule): user code, so the driver asks it in a child of its own."
    s = FineTuneSession.search(model, data, space=space, n_trials=2, runs_root=root,
                               pruner=Median(n_startup_trials=1), num_processes=1,
                               strategy="single", device="cpu", eval_split=0.1, eval_steps=5,
                               logging_steps=5, save_steps=5, max_tokens_per_batch=1024, max_seq_len=256, seed=0)
    print(s.search_id, flush=True)
    time.sleep(3600)
""")


@pytest.mark.processes
def test_search_prunes_and_outlives_its_kernel_and_its_driver(demo, small_train, runs_root):
    kernel = subprocess.Popen([sys.executable, "-c", KERNEL, str(demo.model_dir), str(small_train), str(runs_root)],
                              stdout=subprocess.PIPE, text=True)
    try: sid = kernel.stdout.readline().strip()
    finally:
        if not sid: kernel.kill()
    s = Search.attach(sid, runs_root)
    wait_until(lambda: s.trials() and s.trials()[0]["state"] == "running" and s.state.get("driver"), 120,
               what="trial 0's run started by the driver")
    kernel.kill(); kernel.wait()                                     # the kernel dies: the search goes on
    ProcessRef.from_dict(s.state["driver"]).process().kill()         # and so does its driver, mid-trial
    wait_until(lambda: s.status == "driver gone", 30, what="the dead driver seen")

    s = Search.attach(sid, runs_root)                                # another process takes it up
    s.resume().extend(1)                   # and asks for one more trial: the new driver, running, takes it on
    assert s.wait(timeout=300) == "completed", (s, (s.dir / "driver.log").read_text()[-3000:])
    ts = s.trials()
    assert [t["state"] for t in ts] == ["complete", "pruned", "fail"], ts
    assert [t.state.name for t in s.study.trials] == ["COMPLETE", "PRUNED", "FAIL"]   # Optuna's record, its database
    assert "its run could not start" in ts[2]["reason"] and "learning_rate" in ts[2]["reason"]
    store = RunStore(runs_root)
    assert not store.run_dir(ts[2]["run_id"]).exists()           # the trial its preflight refused: nothing made
    t0, t1 = (store.read_state(t["run_id"]) for t in ts[:2])
    assert t0["status"] == "completed" and t1["status"] == "pruned", (t0.get("reason"), t1.get("reason"))
    assert t1["pruned"]["trial"] == 1 and "pruned by search" in t1["reason"] and t1["pruned"]["step"] < 2000
    assert "(Median pruner)" in t1["reason"] and s.spec["pruner"] == "Median"      # the kernel's own, through the gate
    assert t0["attempt"] == t1["attempt"] == 1                       # no run was started twice by the second driver
    assert t1["search"] == dict(search_id=sid, trial=1, values={"learning_rate": 1e-6, "max_steps": 2000})  # lineage
    pruned = FineTuneSession.attach(ts[1]["run_id"], runs_root)
    assert pruned.checkpoints and pruned.checkpoints[-1]["step"] < 2000         # it stopped early, checkpoint kept
    res = s.results()
    assert list(res.state) == ["complete", "pruned", "fail"] and res.rank_seconds[1] > 0 and res.step[1] < 2000, res
    assert s.best.run_id == ts[0]["run_id"] and s.best_trial["value"] == ts[0]["value"]
    assert (s.dir / "search-report.html").exists() and "pruned" in (s.dir / "search-report.html").read_text()


    with pytest.raises(ValueError, match="already in storage"):     # a second search on the same study: refused
        FineTuneSession.search(demo.model_dir, small_train, space={"learning_rate": [1e-3]}, n_trials=1,
                               runs_root=runs_root, storage=s.spec["storage"], study_name=s.spec["study"],
                               num_processes=1, strategy="single", device="cpu", max_steps=2, eval_split=0.1,
                               eval_steps=1)
    assert Search.list_searches(runs_root) == [sid]

    # the command line: the trials table, the list, the runs' lineage; a bad space refused before anything starts
    def run_cli(*args):
        with contextlib.redirect_stdout(out := io.StringIO()), contextlib.redirect_stderr(err := io.StringIO()):
            code = cli([*map(str, args), "--runs-root", str(runs_root)])
        return code, out.getvalue(), err.getvalue()
    code, out, _ = run_cli("search-status", sid)
    assert code == 0 and "completed: 3 of 3 trials, 1 complete, 1 fail, 1 pruned" in out, out
    assert " pruned " in out.splitlines()[3], out
    assert sid in run_cli("searches")[1] and f"trial 1 of search {sid}" in run_cli("ls")[1]
    cfg = runs_root.parent / "search.yaml"
    cfg.write_text(json.dumps(dict(model=str(demo.model_dir), data=str(small_train), num_processes=1, device="cpu",
                                   strategy="single", eval_split=0.1, eval_steps=5)))
    code, _, err = run_cli("search", cfg, "--space", "learning_rate=log:0:1e-2", "--trials", "2")
    assert code == 2 and "space['learning_rate'] = ('log', 0, 0.01): a log range needs low > 0" in err, err
    assert Search.list_searches(runs_root) == [sid]


class Refuses(optuna.samplers.RandomSampler):
    "A sampler of this file's own class (user code): it fails at its first point, in the method its `at` names."
    at = "sample_independent"
    def before_trial(self, study, trial):
        if self.at == "before_trial": raise ValueError("no trial today")
    def sample_independent(self, study, trial, name, dist): raise ValueError(f"no {name} today")


@pytest.mark.processes
@pytest.mark.parametrize("at", ["sample_independent", "before_trial"])
def test_a_sampler_of_the_users_own_that_raises_fails_the_search_naming_it(demo, small_train, runs_root, at):
    sampler = Refuses()
    sampler.at = at
    s = FineTuneSession.search(demo.model_dir, small_train, space={"learning_rate": ("log", 1e-4, 1e-2)}, n_trials=2,
                               runs_root=runs_root, sampler=sampler, pruner=None, num_processes=1, strategy="single",
                               device="cpu", max_steps=2, eval_split=0.1)
    assert s.wait(timeout=120) == "failed", (s.dir / "driver.log").read_text()[-3000:]
    said = {"sample_independent": "no learning_rate today", "before_trial": "no trial today"}[at]
    assert s.state["reason"].startswith(f"the sampler Refuses.{at} raised ValueError: {said}"), s.state
    # the trial it was asked for, told Optuna as failed (recorded `stopped` where the driver had its number); no run
    assert [t["state"] for t in s.trials()] == (["stopped"] if at == "sample_independent" else [])
    assert all("the search failed: the sampler Refuses" in t["reason"] for t in s.trials())
    assert [t.state.name for t in s.study.trials] == ["FAIL"] and not RunStore(runs_root).list_runs()
