"""The benches' TRL side: a TRL script on two CPU processes under `accelerate launch` (gloo), as ilab_nb launches its
ranks, with one torch thread each. The script writes `result.json` into `out`; its `world` says how many ran."""
import json, os, subprocess, sys, time
from pathlib import Path

from ilab_nb.launcher import ACCELERATE_CONFIG, free_port


def launch_trl(script: Path, args: list, out: Path) -> tuple[float, dict]:
    "`(wall seconds, result.json)` of `script args...` on two processes; exits saying why when TRL fails."
    cfg = out / "accelerate.yaml"; cfg.write_text(ACCELERATE_CONFIG)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(cfg), "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--multi_gpu", "--num_processes", "2",
           "--main_process_port", str(free_port()), str(script), *map(str, args)]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall = time.time() - t0
    (out / "stderr.txt").write_text(r.stderr)
    if r.returncode: raise SystemExit(f"TRL failed (all of its stderr: {out / 'stderr.txt'}):\n{r.stderr[-4000:]}")
    res = json.loads((out / "result.json").read_text())
    if res["world"] != 2: raise SystemExit(f"TRL ran on {res['world']} process(es), not 2")
    return wall, res
