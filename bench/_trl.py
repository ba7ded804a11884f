"""The benches' TRL side: a TRL script on two CPU processes under `accelerate launch` (gloo), as ilab_nb launches its
ranks, with one torch thread each. The script writes `result.json` into `out`; its `world` says how many ran."""
import json, os, signal, subprocess, sys, time
from pathlib import Path

from ilab_nb.launcher import ACCELERATE_CONFIG, free_port


def launch_trl(script: Path, args: list, out: Path, timeout: float | None = None) -> tuple[float, dict]:
    """`(wall seconds, result.json)` of `script args...` on two processes; exits saying why when TRL fails, or when it
    runs past `timeout` seconds (its whole process group killed: a guard against ranks that wait for each other)."""
    cfg = out / "accelerate.yaml"; cfg.write_text(ACCELERATE_CONFIG)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(cfg), "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--multi_gpu", "--num_processes", "2",
           "--main_process_port", str(free_port()), "--log_dir", str(out / "torchelastic"), str(script), *map(str, args)]
    t0 = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    try: _, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        _, err = p.communicate()
        (out / "stderr.txt").write_text(err)
        raise SystemExit(f"TRL ran past {timeout:g} s and was killed (its stderr: {out / 'stderr.txt'}):\n{err[-4000:]}")
    wall = time.time() - t0
    (out / "stderr.txt").write_text(err)
    if p.returncode: raise SystemExit(f"TRL failed (all of its stderr: {out / 'stderr.txt'}):\n{err[-4000:]}")
    res = json.loads((out / "result.json").read_text())
    if res["world"] != 2: raise SystemExit(f"TRL ran on {res['world']} process(es), not 2")
    return wall, res
