"""Two "machines" without SLURM: two `accelerate launch` groups on 127.0.0.1 (num_machines=2, one process each,
gloo on CPU), built by the launcher's own `accelerate_command`, train one real FSDP run to the end."""
import json, os, subprocess

import pytest

from ilab_nb.config import TrainConfig
from ilab_nb.launcher import accelerate_command, free_port, write_accelerate_config


@pytest.mark.processes
def test_two_machines_one_process_each_shard_one_fsdp_run(tmp_path, demo, small_train):
    rd = tmp_path / "run"
    for sub in ("logs", "checkpoints"): (rd / sub).mkdir(parents=True)      # as RunStore.create_run makes them
    cfg = TrainConfig(model=str(demo.model_dir), data=[str(small_train)], device="cpu", num_processes=2, num_machines=2,
                      main_process_ip="127.0.0.1", main_process_port=free_port(), rdzv_backend="c10d", strategy="fsdp",
                      max_steps=4, max_tokens_per_batch=1024, max_seq_len=256, learning_rate=3e-3, save_steps=2)
    cfg.to_json(rd / "config.json")
    d = {**cfg.model_dump(mode="json"), "device": "cpu"}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ILAB_NB_RUN_DIR": str(rd)}
    machines = []
    write_accelerate_config(rd)           # what the supervisor writes before a launch: no user default config applies
    for rank in (1, 0):      # the second machine first: it must wait for the first at the rendezvous
        cmd = accelerate_command(rd, {**d, "machine_rank": rank})
        assert cmd[cmd.index("--machine_rank") + 1] == str(rank) and cmd[cmd.index("--num_processes") + 1] == "2"
        machines.append(subprocess.Popen(cmd, stdout=open(rd / "logs" / f"machine-{rank}.log", "w"), stderr=subprocess.STDOUT,
                                         env=env, cwd=rd))
    codes = [p.wait(timeout=600) for p in machines]
    logs = "\n".join(p.read_text()[-2000:] for p in sorted((rd / "logs").glob("*.log")))
    assert codes == [0, 0], logs
    recs = [json.loads(l) for l in (rd / "metrics.jsonl").read_text().splitlines()]
    head = recs[0]
    assert head["kind"] == "header" and (head["world_size"], head["backend"], head["num_machines"]) == (2, "gloo", 2)
    total, per_rank = head["params_total"], head["params_per_rank"]
    assert len(per_rank) == 2 and sum(per_rank) == total and all(abs(n - total / 2) / total < 0.05 for n in per_rank), per_rank
    assert len(head["nodes"]) == 2
    assert [r["step"] for r in recs if r["kind"] == "train"] == [1, 2, 3, 4]
    assert recs[-1]["event"] == "completed" and (rd / "final" / "config.json").exists()
    assert sorted(p.name for p in (rd / "checkpoints").iterdir()) == ["step-00000002", "step-00000004"]
