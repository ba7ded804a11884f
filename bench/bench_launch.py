"""A run's launch through `accelerate launch` and through `ilab_nb.warm_launch`, side by side: the CPU and the seconds a
run of several CPU processes takes when its ranks are fresh interpreters, and when they are forked from a launcher
that has imported what they import once.

    python bench/bench_launch.py                        # ~3 minutes on 2 cores
    python bench/bench_launch.py --pairs 1 --no-write   # smoke run, prints only

Each sample is one whole launch of a 4-step run of the demo's tiny model on the suite's slice of its data (the
command `launcher.accelerate_command` gives the run, its module swapped for the other way), timed from outside: wall,
and the user + system CPU of the launcher and every rank (the operating system's account of the children, which
includes the ranks the launcher waited for). Both ways run back to back in an order that turns each round; the table
gives medians, the median of the rounds' ratios, and whether the two ways trained the same losses.
"""
import argparse, datetime, json, os, resource, subprocess, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench")); sys.path.insert(0, str(ROOT))
from bench_startup import demo_data, measure

from ilab_nb.config import TrainConfig
from ilab_nb.launcher import accelerate_command, run_env, write_accelerate_config
from ilab_nb.rundir import RunPaths
from ilab_nb.runstore import RunStore

WAYS = ["accelerate.commands.launch", "ilab_nb.warm_launch"]


def launch(way, processes, model, data, losses) -> tuple[float, float]:
    "Wall and CPU seconds of one launch of a fresh run with `processes` ranks; its losses appended to `losses[way]`."
    rd = Path(tempfile.mkdtemp()) / "run"
    RunStore(rd.parent).create_run("run")
    TrainConfig(model=model, data=[data], num_processes=processes, device="cpu", max_steps=4, logging_steps=1,
                learning_rate=1e-3, max_tokens_per_batch=1024, max_seq_len=256, save_steps=None).to_json(RunPaths(rd).config)
    write_accelerate_config(rd)
    cmd = accelerate_command(rd, TrainConfig.read_json(RunPaths(rd).config))
    before, t = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    subprocess.run(cmd[:2] + [way] + cmd[3:], env=run_env(rd), check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    wall, after = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN)
    recs = [json.loads(l) for l in RunPaths(rd).metrics.read_text().splitlines()]
    losses.setdefault(way, []).append([r["loss"] for r in recs if r["kind"] == "train"])
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=4); ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--processes", type=int, nargs="+", default=[2, 4])
    a = ap.parse_args()
    model, data = demo_data()
    lines = ["# A run's launch: every rank a fresh interpreter, or forked from a warm launcher\n",
             f"`python bench/bench_launch.py --pairs {a.pairs}`, {datetime.date.today()}, {os.cpu_count()} CPUs, Python "
             f"{sys.version.split()[0]}; one whole launch a sample (a 4-step run of the demo model on 200 conversations), "
             f"medians of {a.pairs} rounds.\n",
             "| ranks | launcher | wall | CPU (launcher and ranks) | CPU / accelerate launch | losses |",
             "|---:|---|---:|---:|---:|---|"]
    for n in a.processes:
        losses = {}
        r = measure(WAYS, a.pairs, lambda w: launch(w, n, model, data, losses))
        same = all(l == losses[WAYS[0]][0] for w in WAYS for l in losses[w])
        for w, x in r.items():
            lines.append(f"| {n} | `python -m {w}` | {x['wall']:.2f} s | {x['cpu']:.2f} s | {x['cpu_ratio']:.2f} | "
                         f"{'the same in every launch' if same else 'differ: ' + str(losses)} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if not a.no_write: (ROOT / "bench" / "results_launch.md").write_text(text)


if __name__ == "__main__":
    main()
