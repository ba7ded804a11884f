"""The Ray backend on a real two-node Ray cluster started once by this module (`ilab_nb.ray_backend.LocalCluster`: a
head and one added node, one CPU each, on this machine, each started with `ray start`). One scenario covers what a
Ray run does: a 2-machine run of the demo model places one machine on each node and gives the loss curve of the
local 2-process run (which trains beside it); a second run, started while the first holds every CPU of the cluster,
is queued saying for what and is stopped while it waits; `ilab-nb status` and the dashboard name each machine's
node; then the added node is killed and the first run ends `failed` naming it; `resume()` on the head alone (one
machine of both processes) goes on from its last checkpoint, and `stop()` while it trains saves a checkpoint first;
no process is left behind. Every other method on the same cluster, one step each: a LoRA DPO run and a GRPO run, both
at once; the DPO run's fork sweep runs on Ray too, and the finished run is evaluated. (A plain-text run differs from a
chat run only in what its ranks read: tests/test_slurm.py runs one on a cluster. Exporting a run's model is the same
for every backend, a local process reading its `final/`: tests/test_lora.py exports a LoRA run's.) A run too large for
the cluster, and an address nobody answers, are refused before anything is written."""
import json, os, socket, time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="the Ray tests need the ray extra: pip install 'ilab_nb[ray]'")

from ilab_nb import FineTuneSession
from ilab_nb.cli import format_status
from ilab_nb.dashboard import _header_html, _pending_html
from ilab_nb.ray_backend import LocalCluster
from ilab_nb.rundir import RunPaths, schema_problems
from ilab_nb.session import PreflightError
from conftest import FIELDS, run_processes_under, wait_until, within

pytestmark = pytest.mark.processes      # the cluster's raylets and the runs

# The loss of the 2-machine Ray run against the local 2-process run of the same config and seed, step by step.
# Measured here: identical to the last bit (both are 2 gloo ranks with one torch thread each, the same batches in the
# same order): max relative difference 0.0 over 4 steps (and over 6). The tolerance leaves room for a cluster whose
# ranks run another thread count (another summation order in the matmuls): 1e-5 relative, far below the 1e-2 that a
# change of one step or one batch makes to this curve.
LOSS_RTOL = 1e-5
STEPS = 4


@pytest.fixture(scope="module")
def ray_cluster():
    "The module's two-node cluster; this process connected to it (the sessions' preflight asks through it)."
    t0 = time.time()
    c = LocalCluster(nodes=2, num_cpus=1)
    c.start_s = time.time() - t0
    ray.init(address=c.address, log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


def ray_cfg(demo, data, cluster, **kw):
    """A 2-machine DDP run of the demo model on the cluster, a constant learning rate (its first steps do not depend
    on max_steps)."""
    return {**dict(model=str(demo.model_dir), data=str(data), **FIELDS, num_machines=2, strategy="ddp", backend="ray",
                   ray={"address": cluster.address}, lr_scheduler_type="constant", seed=7), **kw}


def train_steps(s, attempt) -> list:
    return [r["step"] for r in s.metrics(as_frame=False) if r.get("kind") == "train" and r.get("attempt") == attempt]


def losses(s, n) -> list:
    return [(r["step"], r["loss"]) for r in s.metrics(as_frame=False) if r.get("kind") == "train"][:n]


def test_a_run_the_cluster_cannot_hold_or_reach_is_refused_before_launch(ray_cluster, runs_root, demo, small_train):
    # 2 machines of 2 CPUs each, on separate nodes of 1 CPU: refused with what it needs and what the nodes have.
    with pytest.raises(PreflightError, match=r"cannot hold this run: it needs 2 machines of 2 CPU, each on its own "
                                             r"node \(STRICT_SPREAD\), but 0 node\(s\) hold that much\. "
                                             r"Its 2 node\(s\) have .*1 CPU"):
        FineTuneSession(**ray_cfg(demo, small_train, ray_cluster, num_processes=4))
    with pytest.raises(PreflightError, match="The Ray cluster at ray.address='127.0.0.1:1' cannot be reached"):
        FineTuneSession(**{**ray_cfg(demo, small_train, ray_cluster), "ray": {"address": "127.0.0.1:1"}})
    assert not runs_root.exists() or not any(runs_root.iterdir())


def test_a_ray_run_trains_as_locally_queues_fails_naming_a_lost_node_resumes_stops_and_completes(
        ray_cluster, runs_root, demo, small_train):
    print(f"cluster start: {ray_cluster.start_s:.1f} s")
    t0 = time.time()
    a = FineTuneSession(**ray_cfg(demo, small_train, ray_cluster, max_steps=400, save_steps=2), name="ray2").start()
    local = FineTuneSession(**{**ray_cfg(demo, small_train, ray_cluster, max_steps=STEPS), "num_machines": 1,
                               "backend": "local", "ray": None}, name="local2").start()
    wait_until(lambda: (a.state.get("ray") or {}).get("machines"), 120, what="the Ray run placed")

    # A second run while the first holds every CPU of the cluster: queued, saying for what; stopped while it waits.
    q = FineTuneSession(**ray_cfg(demo, small_train, ray_cluster, max_steps=2), name="queued").start()
    wait_until(lambda: q.status == "queued" and "waiting for Ray to place 2 machine(s) of 1 CPU"
               in (q.state.get("pending_reason") or ""), 120, what="the second run queued for Ray's resources")
    assert "ray:      waiting for Ray to place" in format_status(q)
    assert "waiting in Ray: waiting for Ray to place" in _pending_html(q.status, q.state)
    assert q.stop(timeout=60) == "cancelled" and q.reason == "stopped on request", q.reason

    wait_until(lambda: len(losses(a, STEPS)) == STEPS and a.checkpoints, 240,
               what=f"{STEPS} steps and a checkpoint of the Ray run")
    first_ray = next(r["time"] for r in a.metrics(as_frame=False) if r.get("kind") == "train") - a.state["created_at"]
    machines = a.state["ray"]["machines"]
    assert [m["machine_rank"] for m in machines] == [0, 1]
    assert {m["node_id"] for m in machines} == set(ray_cluster.node_ids)
    a.monitor.poll()
    head = a.monitor.header
    assert head["world_size"] == 2 and head["num_machines"] == 2
    assert list(head["nodes"]) == [m["node"] for m in machines]    # each rank on its machine's own node
    out = format_status(a)                                         # `ilab-nb status` names each machine's node and IP
    assert all(f"machine {m['machine_rank']} on Ray node {m['node']}" in out for m in machines), out
    assert f"on {machines[0]['node']}, {machines[1]['node']}" in _header_html(a.run_id, 1, head)   # the dashboard
    assert schema_problems(a.state, "state") == []                 # its Ray fields are in the run directory's schema

    # The added node dies as a crash would (the head cannot be removed): the run fails naming it, nothing is left.
    head_id, node = ray_cluster.node_ids
    lost = next(m for m in machines if m["node_id"] == node)
    t1 = time.time()
    ray_cluster.remove_node(node)
    assert a.wait(timeout=60) == "failed", a.status
    print(f"fault: the run failed {a.state['ended_at'] - t1:.1f} s after its node was removed; {a.reason}")
    assert f"Ray node {lost['node']} of machine {lost['machine_rank']} was lost" in a.reason, a.reason
    assert a.state["failed_node"] == lost["node"] and a.state["backend"] == "ray"
    assert "backend:  ray" in format_status(a)

    # resume() places the run anew, on the nodes the cluster has then, and goes on from the last checkpoint: here on
    # the head alone, as one machine of both processes (half a CPU each, so that its one CPU holds them); stop()
    # while it trains saves a checkpoint first, as locally. (A plain resume() waits, queued, until the cluster has two
    # nodes again: shown in nbs/54_ray.ipynb.)
    ra, last, t2 = losses(a, STEPS), a.checkpoints[-1]["step"], time.time()     # attempt 1's, before any other
    a.resume(num_machines=1, ray={"address": ray_cluster.address, "num_cpus_per_process": 0.5})
    wait_until(lambda: train_steps(a, attempt=2), 240, what="a step of the resumed Ray run")
    resumed = time.time() - t2
    assert a.state["resumed_from_step"] == last and train_steps(a, attempt=2)[0] == last + 1
    assert [m["node_id"] for m in a.state["ray"]["machines"]] == ray_cluster.node_ids == [head_id]
    assert a.stop(timeout=60) == "cancelled" and a.reason == "stopped on request", a.reason
    stopped = [r["step"] for r in a.metrics(kinds=("event",)) if r["event"] == "stopped" and r["attempt"] == 2]
    assert stopped == [train_steps(a, attempt=2)[-1]], stopped                 # the step it stopped after ...
    assert a.checkpoints[-1]["step"] == stopped[0], a.checkpoints                # ... is its last checkpoint
    assert schema_problems(a.state, "state") == []
    print(f"resume: its first step {resumed:.1f} s after resume(), from step {last}; stopped after step {stopped[0]}")

    assert local.wait(timeout=300) == "completed", local.reason
    first_local = next(r["time"] for r in local.metrics(as_frame=False)
                       if r.get("kind") == "train") - local.state["created_at"]
    print(f"time to the first step: ray {first_ray:.1f} s, local {first_local:.1f} s (side by side); "
          f"all in {time.time() - t0:.1f} s")
    lo = losses(local, STEPS)
    assert [x for x, _ in ra] == [x for x, _ in lo] == list(range(1, STEPS + 1))
    within("Ray run's loss against the local run's (max relative difference)",
           max(abs(x - y) / abs(y) for (_, x), (_, y) in zip(ra, lo)), LOSS_RTOL, "0.0 measured over 4 and 6 steps")
    wait_until(lambda: not run_processes_under(runs_root), 30, what="no process of the runs left")


def test_every_method_runs_on_ray_and_its_runs_fork_sweep_and_evaluate(ray_cluster, runs_root, demo, tmp_path):
    """SFT is the scenario above; here a LoRA DPO run and a GRPO run with an environment (the agent demo's vault, its
    tool called in the rank's user-code process on a Ray worker), one process each (half a CPU: both at once), one step
    each; then the DPO run's fork sweep (on Ray, as its parent) and its evaluation. (Its export is not repeated here: a
    local export process reads `final/` whichever backend wrote it, and the adapters in it are asserted below; exporting
    a LoRA run's final model and checkpoint is tests/test_lora.py's check, q8_0 tests/test_export.py's.)"""
    from ilab_nb.agent_demo import agent_assets
    from test_agents import AGENT_RUN
    from test_dpo import DPO
    from test_lora import LORA
    agent = agent_assets()                 # built once per machine (test_agents builds it too, under a lock)
    t0 = time.time()
    one = dict(num_machines=1, num_processes=1, strategy="fsdp", max_steps=1, save_steps=None, eval_steps=None,
               ray={"address": ray_cluster.address, "num_cpus_per_process": 0.5})
    pairs, held = tmp_path / "pairs.jsonl", tmp_path / "held.jsonl"
    pairs.write_text("".join(Path(demo.pref_train_file).read_text().splitlines(keepends=True)[:16]))
    held.write_text("".join(Path(demo.pref_eval_file).read_text().splitlines(keepends=True)[:4]))
    runs = {"dpo": FineTuneSession(**ray_cfg(demo, pairs, ray_cluster, **{**DPO, **one, "save_steps": 1}, lora=LORA,
                                             eval_data=str(held)), name="dpo"),
            "grpo": FineTuneSession(**ray_cfg(demo, agent.train_file, ray_cluster, **{**AGENT_RUN, **one,
                                              "max_completion_length": 32}, model=str(agent.model_dir),
                                              environment_factory="ilab_nb.agent_demo:AgentVault"), name="grpo")}
    for s in runs.values(): s.start()
    for k, s in runs.items():
        assert s.wait(timeout=300) == "completed", (k, s.reason)
        assert s.state["backend"] == "ray" and len(s.state["ray"]["machines"]) == 1, (k, s.state)
    print(f"LoRA DPO and GRPO-with-tools runs on Ray: {time.time() - t0:.1f} s")
    train = {k: [r for r in s.metrics() if r["kind"] == "train"] for k, s in runs.items()}
    head = {k: s.monitor.header for k, s in runs.items()}
    assert all([r["step"] for r in t] == [1] for t in train.values()), train
    assert (head["dpo"]["method"], head["dpo"]["finetuning"]) == ("dpo", "lora")
    assert {"rewards/chosen", "rewards/margins"} <= set(train["dpo"][0])
    dpo = RunPaths(runs["dpo"].run_dir)
    assert (dpo.final / "adapter" / "adapter_model.safetensors").is_file()
    assert (dpo.checkpoint(1) / "adapter_model.safetensors").is_file()
    assert not list(dpo.checkpoint(1).glob("model*.safetensors"))           # the adapters, no copy of the base
    assert head["grpo"]["method"] == "grpo" and {"reward", "rewards/AgentVault/mean"} <= set(train["grpo"][0])
    assert train["grpo"][0]["tools/call_frequency"] > 0 and train["grpo"][0]["tools/failure_frequency"] == 0
    (comp,) = runs["grpo"].metrics(kinds=("completions",))
    assert any(m["role"] == "tool" for c in comp["completions"] for m in c["episode"]), comp     # its episodes

    # The DPO run's fork sweep (one fork from its step-1 checkpoint, its own learning rate, one step, on Ray as its
    # parent: one fork shows where a sweep's forks run as well as two, and a fork on Ray is an attempt of 5 processes;
    # sweeps of several combinations are tests/test_grpo.py's and the notebooks') and its evaluation (a local lm-eval
    # process on its final model: the suite's one evaluation of a LoRA run's adapters to the end), side by side.
    t1 = time.time()
    sw = runs["dpo"].fork_sweep(1, max_steps=2, learning_rate=[2e-3])
    assert sw.spec["forked_from"] == {"run_id": runs["dpo"].run_id, "step": 1}
    assert [f.config.learning_rate for f in sw.sessions] == [2e-3] != [runs["dpo"].config.learning_rate]
    ev = runs["dpo"].evaluate(["heldout_preference"], base=False)
    assert ev.wait(timeout=300) == "completed", ev.reason
    assert ev.spec["tasks"] == ["heldout_preference"] and len(ev.results())
    for f in sw.sessions:
        assert f.wait(timeout=300) == "completed", f.reason
        assert f.state["backend"] == "ray" and len(f.state["ray"]["machines"]) == 1
        assert train_steps(f, attempt=1) == [2]
    print(f"fork sweep and evaluation of the DPO run: {time.time() - t1:.1f} s; "
          f"all in {time.time() - t0:.1f} s")


def test_a_node_whose_raylet_dies_before_it_registers_is_said_at_once(ray_cluster):
    """A node whose raylet cannot bind its port exits at once and never registers: `add_node` says so, with the
    raylet's own reason, while `ray start` still waits for it (Ray's fixed 30 s; `ray start` is stopped, and what it
    started), not after the cluster's whole timeout (300 s); the cluster's nodes are left as they were."""
    nodes, raylets = list(ray_cluster.node_ids), ray_cluster._raylets()
    assert len(raylets) == len(nodes)                      # one running raylet for each live node
    head_err = ray_cluster.temp_dir / "session_latest" / "logs" / "raylet.err"     # the head's, which writes on (a
    with open(head_err, "a") as f: f.write("E the head's raylet: the disk is nearly full\n")   # full disk, say):
    os.utime(head_err, (time.time() + 3600,) * 2)          # newer than the new node's, and not what it says
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0)); busy.listen()
        port, t0 = busy.getsockname()[1], time.time()
        with pytest.raises(RuntimeError, match="lost its raylet before it registered") as e:
            ray_cluster.add_node([f"--address={ray_cluster.address}", f"--object-manager-port={port}"])
    print(f"a node whose raylet died: said {time.time() - t0:.1f} s after `ray start` began")
    assert "Address already in use" in str(e.value), str(e.value)
    assert "exited while ray start waited for it: ray start stopped" in str(e.value), str(e.value)
    assert not ray_cluster._processes(f"--object-manager-port={port}")           # nothing of it left
    assert ray_cluster.node_ids == nodes and sorted(ray_cluster.alive()) == sorted(nodes)
    assert ray_cluster._raylets() == raylets
