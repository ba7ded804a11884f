"""Stress check (not in the default suite): SIGKILL one rank of a real 2-rank FSDP run, N times in a row, and count
how often the failure reason names the killed rank (issue: the reason must not depend on which exit the launcher
happened to see first).

    .venv/bin/python tools/stress_rank_kill.py            # 20 runs, rank 1 killed each time
    .venv/bin/python tools/stress_rank_kill.py -n 10 --rank 0
    .venv/bin/python tools/stress_rank_kill.py --monitor-interval 3   # the hard case, see below

With `--monitor-interval 3` torchrun looks at its ranks only every 3 s, so by the time it looks, rank 0 has
already failed on its broken connection too; both exits carry the same timestamp and torchrun's report names
rank 0 as the "Root Cause (first observed failure)" every time. The reason must still name the killed rank.

Each run: a fresh FineTuneSession on the demo model (2 CPU processes, FSDP), wait for its first train record, kill the
rank, wait for `failed`, check `failed_rank` and that the reason says "rank R ... SIGKILL". Exit code 0 only at N/N.
"""
import argparse, os, signal, sys, tempfile, time

signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))   # run the clean-up below when told to stop
from pathlib import Path

from ilab_nb.demo import demo_assets
from ilab_nb.monitor import RunMonitor
from ilab_nb.runstore import run_processes
from ilab_nb.session import FineTuneSession


def wait(pred, timeout, what):
    t0 = time.time()
    while time.time() - t0 < timeout:
        v = pred()
        if v: return v
        time.sleep(0.2)
    raise TimeoutError(f"timed out after {timeout} s waiting for {what}")


def one(i, rank, assets, train, root, launcher_args):
    s = FineTuneSession(assets.model_dir, train, runs_root=root, run_id=f"stress-{i:02d}", num_processes=2, device="cpu",
                        max_seq_len=256, max_tokens_per_batch=1024, logging_steps=1, max_steps=100000,
                        launcher_args=launcher_args).start()
    try: return kill_and_judge(s, rank)
    finally:
        if s.status not in ("completed", "failed", "cancelled"): s.stop(grace_s=0, timeout=60)   # interrupted


def kill_and_judge(s, rank):
    m = RunMonitor(s.run_dir)
    wait(lambda: (m.poll(), m.train_records or s.status in ("completed", "failed", "cancelled"))[1], 300, "the first train record")
    if not m.train_records: return False, f"the run ended before training ({s.status}): {s.reason}", None
    victim = wait(lambda: [p for p in run_processes(s.run_dir) if p.environ().get("RANK") == str(rank)
                           and "ilab_nb.worker" in " ".join(p.cmdline())], 30, f"rank {rank}")[0]
    victim.send_signal(signal.SIGKILL)
    wait(lambda: s.status == "failed", 120, "the run to fail")
    st = s.state
    ok = st.get("failed_rank") == rank and f"rank {rank} was killed by signal SIGKILL" in st["reason"]
    wait(lambda: not run_processes(s.run_dir), 30, "every process of the run to end")
    log = (s.run_dir / "logs" / "supervisor.log").read_text()
    root = log[log.rfind("Root Cause"):].split("rank", 1)[-1][:20] if "Root Cause" in log else ""
    torchrun_rank = int(root.split(":")[1].split()[0]) if ":" in root else None
    return ok, st["reason"], torchrun_rank


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=20); ap.add_argument("--rank", type=int, default=1)
    ap.add_argument("--monitor-interval", type=float, help="torchrun's --monitor_interval (seconds between its looks)")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ilab-stress-"))
    os.environ.setdefault("ILAB_NB_LOCKS", str(tmp / "locks"))
    assets = demo_assets(tmp / "demo")
    train = tmp / "train.jsonl"
    train.write_text("".join(Path(assets.train_file).read_text().splitlines(keepends=True)[:200]))
    largs = ["--monitor_interval", str(a.monitor_interval)] if a.monitor_interval else []
    named = other = 0
    for i in range(a.n):
        ok, reason, torchrun_rank = one(i, a.rank, assets, train, tmp / "runs", largs)
        named += ok; other += torchrun_rank is not None and torchrun_rank != a.rank
        print(f"run {i + 1:2d}/{a.n}: {'named' if ok else 'WRONG'} (torchrun's first observed: rank {torchrun_rank}): "
              f"{reason[:200]}", flush=True)
    print(f"\nthe reason named the killed rank {a.rank} in {named}/{a.n} runs "
          f"(torchrun's 'first observed failure' named another rank in {other} of them)")
    return 0 if named == a.n else 1


if __name__ == "__main__": sys.exit(main())
