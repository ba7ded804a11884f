"""The SLURM backend on a real two-node SLURM cluster started by this module (tests/slurm_cluster.py): every node
(one CPU each) runs one rank of a 2-machine FSDP run of the demo model. Several scenarios share a few runs: two
submissions queue in SLURM, a queued job is cancelled from outside, a run (GRPO with tools: the agent demo's model and
environment, and a reward function defined here) is stopped, resumed and requeued to the end while a second (continued
pretraining on plain text) runs and loses a rank, and a new process attaches; a DPO run with LoRA adapters saves before its time limit, resumes and loses a node."""
import os, re, signal, subprocess, sys, time
from functools import partial
from pathlib import Path

import psutil
import pytest
import yaml

from ilab_nb import FineTuneSession
from ilab_nb.cli import main
from ilab_nb.rundir import RunPaths
from ilab_nb.session import PreflightError
from conftest import rank_process, run_processes_under, wait_until
from slurm_cluster import Cluster, why_not

pytestmark = pytest.mark.processes      # the cluster's daemons, and the runs
SLURM_REASONS = ("Resources", "Priority", "Dependency", "Nodes_required")   # why squeue says a job waits


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = why_not()
    if why: pytest.skip(f"no test SLURM cluster: {why}")
    c = Cluster(tmp_path_factory.mktemp("slurm")).start()
    old = {k: os.environ.get(k) for k in c.env}
    os.environ.update(c.env)
    yield c
    subprocess.run(["scancel", "--user", "root"], capture_output=True)   # jobs end before their nodes stop: no slurmstepd is left
    try: wait_until(lambda: not subprocess.run(["squeue", "-h"], capture_output=True, text=True).stdout.strip(), 60, what="no job left")
    finally: c.stop()
    for k, v in old.items():
        if v is None: os.environ.pop(k, None)
        else: os.environ[k] = v


def run_cfg(demo, small_train, **kw):
    return {**dict(model=str(demo.model_dir), data=str(small_train), device="cpu", num_processes=2, num_machines=2,
                   backend="slurm", rdzv_backend="c10d", strategy="fsdp", max_tokens_per_batch=1024, max_seq_len=256,
                   learning_rate=3e-3, logging_steps=1, slurm={"partition": "debug", "time": "00:20:00"}), **kw}


def letters_holding(hold: Path):
    """A GRPO reward defined in this test module (the runs' processes on the nodes get it saved by value). While the
    file `hold` names a step, the scoring of the step after it (TRL's `trainer_state.global_step`: the steps done)
    waits until the file is gone (5 minutes at most): no checkpoint can follow that step's until the test lets it."""
    def letters(prompts, completions, trainer_state, **kw):
        if hold.exists() and trainer_state.global_step == int(hold.read_text()):
            t = time.time()
            while hold.exists() and time.time() - t < 300: time.sleep(0.2)
        return [sum(ch.isalpha() for ch in c[-1]["content"]) / 8 for c in completions]
    return letters


def test_preflight_refuses_what_slurm_cannot_run(cluster, runs_root, demo, small_train, tmp_path, capsys):
    with pytest.raises(PreflightError, match="not a partition of this cluster; sinfo lists debug"):
        FineTuneSession(**{**run_cfg(demo, small_train), "slurm": {"partition": "gpu"}})
    with pytest.raises(PreflightError, match="partition 'debug' has 2"):
        FineTuneSession(**{**run_cfg(demo, small_train), "num_machines": 3, "num_processes": 3})
    # `ilab-nb run` honours backend: slurm and a slurm: mapping of a YAML config, and refuses the same way. Its `main`
    # in this process, as tests/test_hostile.py calls it: the command line's own process only imports (7 CPU-s measured
    # here); what `ilab-nb` does with the file is `main`'s.
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({**run_cfg(demo, small_train), "slurm": {"partition": "gpu"}}))
    capsys.readouterr()
    code, out = main(["run", str(cfg)]), "".join(capsys.readouterr())
    assert code != 0 and "slurm.partition='gpu' is not a partition of this cluster" in out, (code, out)
    assert not runs_root.exists()


def test_two_node_runs_queue_stop_resume_fail_and_attach(cluster, runs_root, demo, small_train, tmp_path):
    from ilab_nb.agent_demo import agent_assets
    agent = agent_assets()                # built once per machine (test_agents builds it too, under a lock)
    hold = tmp_path / "hold"                  # the step whose checkpoint run a is requeued at (below)
    grpo = dict(method="grpo", model=str(agent.model_dir), data=str(agent.train_file),
                reward_funcs=[letters_holding(hold)],
                environment_factory="ilab_nb.agent_demo:AgentVault", max_tool_calling_iterations=1, tool_timeout=30,
                num_generations=4, per_device_train_batch_size=4, max_completion_length=32)   # a prompt per rank a step
    # 12 steps, a checkpoint every 4: stopped after its first steps (1-3), resumed, requeued once it saved step 4 (and
    # held there: its reward waits at step 5 until then), it has 8 steps left.
    a = FineTuneSession(**{**run_cfg(demo, small_train, max_steps=12, save_steps=4, **grpo),
                           "slurm": {"partition": "debug", "time": "00:20:00", "requeue": True}}, name="a").start()
    script = (a.run_dir / "slurm-attempt-1.sbatch").read_text()
    assert "#SBATCH --nodes=2" in script and "srun --kill-on-bad-exit=1" in script
    assert a.state["job_id"] and a.state["backend"] == "slurm"
    b = FineTuneSession(**run_cfg(demo, small_train, max_steps=40, data=str(demo.text_train_file)), name="b").start()   # plain text
    c = FineTuneSession(**run_cfg(demo, small_train, max_steps=4), name="c").start()

    # Two submissions queue in SLURM: the second waits, with SLURM's reason.
    wait_until(lambda: b.status == "queued" and b.state.get("pending_reason") not in (None, "None"), 60, poll=1,
               what="b queued with a reason")
    assert b.state["pending_reason"] in SLURM_REASONS
    # The dashboard says why SLURM keeps it waiting: the reason as it read it (SLURM's changes, Resources -> Priority).
    dash = b.dashboard()
    shown = wait_until(lambda: [dash.update(), re.search(r"waiting in SLURM \(job (\d+)\): (\w+)</span>", dash.badge.value)][1],
                       60, what="the dashboard's SLURM reason")
    assert shown[1] == str(b.state["job_id"]) and shown[2] in SLURM_REASONS, dash.badge.value

    # scancel from outside (a queued job): terminal, with the reason; nothing stuck.
    subprocess.run(["scancel", c.state["job_id"]], check=True)
    assert c.wait(timeout=60, poll_s=1) == "cancelled" and "outside ilab_nb" in c.reason

    # A runs on both nodes; stop() checkpoints and cancels it.
    wait_until(lambda: a.status == "running" and a.progress()["step"], 300, what="run a training")
    head = a.monitor.header
    assert head["world_size"] == 2 and head["num_machines"] == 2 and sorted(head["nodes"]) == ["n1", "n2"]
    assert (head["method"], head["data_kind"]) == ("grpo", "prompt")
    assert len(head["params_per_rank"]) == 2 and all(abs(n - head["params_total"] / 2) / head["params_total"] < 0.05 for n in head["params_per_rank"])
    assert a.stop(timeout=240) == "cancelled" and a.reason == "stopped on request" and a.checkpoints
    stopped_at = a.checkpoints[-1]["step"]
    assert sorted(p.name for p in (a.run_dir / "logs").glob("node-*.log")) == ["node-n1.log", "node-n2.log"]

    # A resumes as a new job, queued behind B, which now runs; a rank of B is killed on its node.
    # Where the stop lands depends on how fast a trains (step 9 was seen under load): the resume's max_steps leaves 4
    # steps (one checkpoint's worth) after the first checkpoint past the stop, wherever the stop landed (8 when it
    # landed in steps 1-3); the hold below keeps attempt 2 at the step after that checkpoint until it is requeued.
    total = (stopped_at // 4 + 1) * 4 + 4
    hold.write_text(str(total - 4))           # its second attempt's scoring waits after that checkpoint (below)
    a.resume(max_steps=total)
    assert a.state["attempt"] == 2
    wait_until(lambda: b.status == "running", 300, poll=1, what="run b running")
    wait_until(lambda: a.status == "queued" and a.state.get("pending_reason") not in (None, "None"), 60, poll=1,
               what="a queued again")
    wait_until(lambda: b.progress()["step"], 300, poll=1, what="run b training")
    head_b = b.monitor.header            # continued pretraining on plain text, packed, sharded over both nodes
    assert (head_b["data_kind"], head_b["world_size"], sorted(head_b["nodes"])) == ("text", 2, ["n1", "n2"])
    assert "documents packed into" in head_b["data_stats"]["train"]["note"]
    victim = wait_until(lambda: rank_process(b.run_dir, 1), 60, what="rank 1 of b")
    node = head_b["nodes"][1]
    victim.send_signal(signal.SIGKILL)
    assert b.wait(timeout=240, poll_s=1) == "failed"
    assert f"rank 1 on node {node} was killed by signal SIGKILL" in b.reason, b.reason
    assert f"rank 1 on node {node} was killed by signal SIGKILL" in RunPaths(b.run_dir).report.read_text()   # its observer's report

    # A runs from its checkpoint; once it has saved another, `scontrol requeue` of its job (as a preemption does):
    # SLURM starts the job again, and it resumes from the latest complete checkpoint as attempt 3. Its reward holds
    # the step after that checkpoint until the requeued job is pending (its processes gone): no later checkpoint can
    # come between, however slowly the requeue lands.
    wait_until(lambda: a.status == "running" and any(r.get("attempt") == 2 for r in a.metrics(kinds=("train",))), 400,
               poll=1, what="run a's second attempt training")
    wait_until(lambda: a.checkpoints and a.checkpoints[-1]["step"] > stopped_at, 300, poll=1,
               what="run a's second attempt to save a checkpoint")
    requeued_at = a.checkpoints[-1]["step"]
    assert requeued_at == total - 4, a.checkpoints
    subprocess.run(["scontrol", "requeue", a.state["job_id"]], check=True)
    # SLURM holds a requeued job before it is eligible again (about 2 minutes here); an administrator's release:
    wait_until(lambda: "PENDING" in subprocess.run(["scontrol", "show", "job", "-o", a.state["job_id"]], capture_output=True,
                                                   text=True).stdout, 120, poll=1, what="the requeued job pending")
    hold.unlink()                             # attempt 3 scores that step on
    subprocess.run(["scontrol", "update", f"JobId={a.state['job_id']}", "StartTime=now"], check=True)
    # A finishes; the model loads; a new process sees every step.
    assert a.wait(timeout=400, poll_s=1) == "completed", a.reason
    assert ">completed</span>" in RunPaths(a.run_dir).report.read_text() and RunPaths(a.run_dir).loss_png.exists()
    model, tok = a.load_model()
    assert model.num_parameters() == head["params_total"]
    a.monitor.poll(); headers = [r for r in a.monitor.records if r.get("kind") == "header"]
    assert [(h["attempt"], h.get("resumed_from_step")) for h in headers][1:] == [(2, stopped_at), (3, requeued_at)], headers
    assert a.state["attempt"] == 3
    out = subprocess.run([sys.executable, "-c", f"from ilab_nb import FineTuneSession as S; s = S.attach({a.run_id!r}); "
                          "print(s.status, sorted({r['step'] for r in s.metrics() if r['kind'] == 'train'}))"],
                         capture_output=True, text=True, timeout=120, env=os.environ)
    assert out.stdout.strip() == f"completed {list(range(1, total + 1))}", out.stdout + out.stderr
    train = a.metrics(kinds=("train",))        # scored on the nodes: the reward function, the vault's, its tools
    assert all(r["prompts"] == 2 and {"rewards/letters/mean", "rewards/AgentVault/mean"} <= set(r) for r in train)
    assert sum(r["tools/call_frequency"] for r in train) > 0 and not any(r["tools/failure_frequency"] for r in train)

    # No process of any run survives it, on either node.
    wait_until(lambda: not run_processes_under(runs_root), 60, what="every process of the runs gone")
    assert {r["status"] for r in FineTuneSession.list_runs()} == {"completed", "failed", "cancelled"}
    # Everything the SLURM backend wrote is in the run-directory schema.
    from ilab_nb.rundir import schema_problems
    for s in (a, b, c):
        probs = schema_problems(s.store.read_state(s.run_id), "state")
        probs += [p for e in s.store.events(s.run_id) for p in schema_problems(e, "lifecycle")]
        probs += [p for r in s.monitor.records if r.get("kind") in ("header", "train", "eval", "event") for p in schema_problems(r, r["kind"])]
        assert not probs, (s.run_id, probs)


def test_time_limit_saves_first_resume_continues_and_a_node_failure_ends_it(cluster, runs_root, demo, small_train, tmp_path,
                                                                          monkeypatch):
    # A job with a 2-minute limit is signalled before it: every rank saves, and the run ends failed saying "time
    # limit", with that checkpoint, before SLURM has to kill anything. slurmctld sends a job's --signal at its first
    # time-limit check (every 30 s) once the job is within the lead of its limit. The default lead, a tenth of the limit
    # or at least 30 s, would have the signal come 90-120 s into the job: the user's own --signal, 100 s, is kept
    # instead, so it comes 20-50 s into the job, well after the batch script set its trap (its first lines). (A lead of
    # 115 s, signalling 5-35 s in, saved no CPU that could be measured and left the trap 5 s.) The ranks look for a
    # stop request after each step, so they train at least one step and save it whenever the signal comes. The run is
    # DPO with LoRA adapters on 64 of the demo's preference pairs: the adapters' checkpoint and the kept reference
    # log-probabilities carry it across the jobs. Its ranks pause a second after each step (tests/paced_worker.py):
    # until the signal comes they would otherwise train flat out, on both cores, steps nothing reads.
    import ilab_nb.slurm as slurm_mod
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setattr(slurm_mod, "accelerate_command", partial(slurm_mod.accelerate_command, worker_module="paced_worker"))
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(Path(demo.pref_train_file).read_text().splitlines(keepends=True)[:64]))
    t = FineTuneSession(**{**run_cfg(demo, small_train, max_steps=2000, save_steps=1000, data=str(pairs), method="dpo",
                                     beta=0.1, lora={"r": 8, "lora_alpha": 16}),
                           "slurm": {"partition": "debug", "time": "00:02:00", "sbatch_lines": ["--signal=B:USR1@100"]}},
                        name="t").start()
    script = (t.run_dir / "slurm-attempt-1.sbatch").read_text()
    assert "#SBATCH --signal=B:USR1@100" in script and "@30" not in script
    assert t.wait(timeout=400, poll_s=1) == "failed"
    assert "reached its time limit (00:02:00)" in t.reason and "saved checkpoint step-" in t.reason, t.reason
    assert t.state["job_state"] == "COMPLETED" and t.checkpoints, t.state      # it stopped itself: SLURM killed nothing
    ck = t.checkpoints[-1]["step"]
    assert f"step-{ck:08d}" in t.reason
    reference = RunPaths(t.run_dir).reference_logps.read_bytes()       # computed once, by attempt 1

    # resume() continues it from that checkpoint as attempt 2, given more time with the resume (the slurm options are
    # among what a resume may change), so the limit's signal is not next: its job is submitted with the new limit and
    # the default lead (at 18 minutes), with no moment when the old one's signal could come.
    t.resume(slurm={"partition": "debug", "time": "00:20:00"})
    script = (t.run_dir / "slurm-attempt-2.sbatch").read_text()
    assert "#SBATCH --time=00:20:00" in script and "#SBATCH --signal=B:USR1@120" in script and "@100" not in script
    wait_until(lambda: t.status == "running" and (t.progress()["step"] or 0) > ck, 400, poll=1,
               what="attempt 2 training past the checkpoint")
    t.monitor.poll(); head = [r for r in t.monitor.records if r.get("kind") == "header"][-1]
    assert (head["attempt"], head["resumed_from_step"]) == (2, ck)
    assert (head["method"], head["finetuning"], head["world_size"]) == ("dpo", "lora", 2)
    assert RunPaths(t.run_dir).reference_logps.read_bytes() == reference    # read back, not recomputed from the policy

    # The node of rank 1 fails (set down, as SLURM does with a node that stops answering): the run fails naming it,
    # and no process of the run is left on either node.
    node = head["nodes"][1]
    subprocess.run(["scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=ilab_nb test node failure"], check=True)
    try:
        assert t.wait(timeout=180, poll_s=1) == "failed"
        assert f"lost node {node} (" in t.reason and "ilab_nb test node failure" in t.reason, t.reason
        assert t.state["failed_node"] == node and t.state["job_state"].startswith("NODE_FAIL"), t.state
        wait_until(lambda: not run_processes_under(runs_root), 60, what="every process of the run gone, on both nodes")
    finally:      # given back; the last test of the module does not wait for it to answer again (the cluster stops next)
        subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], capture_output=True)
