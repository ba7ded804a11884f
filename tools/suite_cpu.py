"""Where the test suite's CPU goes: pytest run as `make pytest` runs it, every process on the machine read (psutil)
four times a second, each counted by what it is (a rank, a supervisor, `accelerate launch`, the command line, Ray's
daemons, a Jupyter kernel, ...) and by the test that started it (`PYTEST_CURRENT_TEST` in its environment, else the
test's directory in its command line). Writes a markdown table (default bench/results_suite.md) and the raw samples.

    .venv/bin/python tools/suite_cpu.py                       # the whole suite, 2 workers: as long as `make pytest`
    .venv/bin/python tools/suite_cpu.py -- tests/test_ray.py  # other pytest arguments after --

A process that was running before pytest counts only the CPU it used after. What it cannot see: a process that lives
less than a sample's interval (0.25 s) is missed, and each process loses
the CPU it used after its last sample; Ray's worker processes inherit the environment of the raylet that started them,
so they count for the test that started the cluster. The pytest workers' own CPU (collection, the tests that run in
them, their polling) is one row: it is not split by test."""
import argparse, collections, json, os, re, signal, subprocess, sys, threading, time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
# (a piece of the command line, the kind): the first that matches names the process
KINDS = [("accelerate.commands.launch", "accelerate launch"), ("ilab_nb.warm_launch", "warm launcher"),
         ("torch.distributed.run", "torchrun"),
         ("bin/torchrun ", "torchrun"),
         ("ilab_nb.worker", "rank"), ("nan_worker", "rank"), ("fault_worker", "rank"), ("paced_worker", "rank"),
         ("ilab_nb.supervisor", "supervisor"), ("ilab_nb.usercode", "user-code worker"),
         ("ilab_nb.evaluation", "evaluation"), ("ilab_nb.export", "export"), ("lm_eval", "lm-eval command line"),
         ("lm-eval", "lm-eval command line"), ("ilab_nb.cli", "ilab-nb command line"),
         ("ilab-nb", "ilab-nb command line"),
         ("gpu_check", "GPU check (dry run)"), ("bench_gpu", "GPU check (dry run)"),
         ("ilab_nb.ray_backend", "Ray: a run's launcher"), ("ray::Machine", "Ray: a machine's actor"),
         *[(k, "Ray: daemons and idle workers") for k in ("raylet", "gcs_server", "ray::", "/site-packages/ray/",
                                                           "ray.scripts", "ray.util", "ray._private")],
         ("slurm", "SLURM daemons and commands"), ("munge", "SLURM daemons and commands"),
         ("srun", "SLURM daemons and commands"), ("scontrol", "SLURM daemons and commands"),
         ("squeue", "SLURM daemons and commands"), ("sbatch", "SLURM daemons and commands"),
         ("ipykernel", "Jupyter kernel"), ("jupyter", "JupyterLab server"), ("chrom", "Chromium"),
         ("headless_shell", "Chromium"), ("playwright", "Playwright driver"),
         ("exec(eval(sys.stdin", "pytest worker"), ("-m pytest", "pytest (controller)")]


def kind_of(cmdline: str) -> str:
    return next((k for key, k in KINDS if key in cmdline), "other Python" if "python" in cmdline else "other")


def test_of(environ: dict, cmdline: str):
    "The test that started a process: its PYTEST_CURRENT_TEST, else the pytest directory named in its command line."
    if t := environ.get("PYTEST_CURRENT_TEST"): return t.split(" (")[0]
    m = re.search(r"/popen-gw\d+/(test_[^/\s]+?)\d*/", cmdline)
    return f"(directory) {m.group(1)}" if m else None


def busy_idle() -> tuple:
    "The machine's busy and idle CPU-seconds since boot."
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq + t.steal, t.idle + t.iowait


def sample(seen: dict, me: set, first: bool = False):
    "Read every process; on the `first` sweep, what each had used before the run is its base (not counted)."
    for p in psutil.process_iter():
        if p.pid in me: continue
        try:
            with p.oneshot():
                cpu, cl = sum(p.cpu_times()[:2]), " ".join(p.cmdline()).strip()
                e = seen.setdefault((p.pid, p.create_time()), {"cpu": 0.0, "base": cpu if first else 0.0,
                                                               "cmdline": "", "kind": None, "test": None})
            if cl and cl != e["cmdline"]:          # after an exec the command line is the new program's
                e["cmdline"], e["kind"] = cl[:400], kind_of(cl)
                try:                               # a rank forked by its launcher has the launcher's command line
                    if e["kind"] == "warm launcher" and " ".join(p.parent().cmdline()).strip() == cl: e["kind"] = "rank"
                except (psutil.Error, AttributeError): pass
                try: e["test"] = test_of(p.environ(), cl) or e["test"]
                except psutil.Error: pass
            e["cpu"] = max(e["cpu"], cpu - e["base"])
        except psutil.Error: pass


def table(rows, head) -> list:
    return [f"| {' | '.join(head)} |", "|" + "---|" * len(head)] + [f"| {' | '.join(map(str, r))} |" for r in rows]


def report(procs: list, wall: float, busy: float, idle: float, args: list, rc: int, tail: str, at: str) -> str:
    counted = [p for p in procs if p["kind"] and p["cpu"] > 0]
    total = sum(p["cpu"] for p in counted)
    by_kind, n_kind = collections.Counter(), collections.Counter()
    for p in counted:
        by_kind[p["kind"]] += p["cpu"]
        n_kind[p["kind"]] += 1
    by_test, by_module = collections.Counter(), collections.Counter()
    kinds_of = collections.defaultdict(collections.Counter)
    for p in counted:
        if not p["test"] or p["kind"] in ("pytest worker", "pytest (controller)"): continue
        by_test[p["test"]] += p["cpu"]; kinds_of[p["test"]][p["kind"]] += 1
        by_module[p["test"].split("::")[0]] += p["cpu"]
    out = [f"# Where the test suite's CPU goes (`tools/suite_cpu.py`)", "",
           f"`pytest {' '.join(args)}` on this machine ({os.cpu_count()} cores), "
           f"{at}: exit {rc}, {tail}.", "",
           f"Wall {wall:.0f} s; the machine was busy {busy:.0f} CPU-s and idle {idle:.0f} CPU-s "
           f"({busy / max(busy + idle, 1e-9):.0%} busy); {total:.0f} CPU-s were read from the processes below "
           f"(the rest: processes shorter than a sample, and the CPU each used after its last one).", "",
           "## By kind of process", ""]
    out += table([(k, f"{v:.0f}", f"{v / total:.0%}", n_kind[k], f"{v / n_kind[k]:.2f}")
                  for k, v in by_kind.most_common()], ("process", "CPU-s", "share", "processes", "CPU-s each"))
    out += ["", "## By test module (the processes its tests started; the pytest workers' own CPU is not split)", ""]
    out += table([(m, f"{v:.0f}") for m, v in by_module.most_common()], ("module", "CPU-s"))
    out += ["", "## The 25 tests whose processes took the most", ""]
    out += table([(t.split("::", 1)[-1][:110], f"{v:.0f}", ", ".join(f"{k} {n}" for k, n in kinds_of[t].most_common()))
                  for t, v in by_test.most_common(25)], ("test", "CPU-s", "processes started"))
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results_suite.md"))
    ap.add_argument("--raw", default=str(ROOT / "artifacts" / "suite_cpu.json"), help="every process, as JSON")
    ap.add_argument("--from-raw", action="store_true", help="only write the table again from --raw")
    ap.add_argument("pytest_args", nargs="*", default=["tests", "-q", "-ra", "-n", "2", "--dist", "loadgroup"])
    a = ap.parse_args()
    if a.from_raw:
        run = json.loads(Path(a.raw).read_text())
        Path(a.out).write_text(report(**{k: run[k] for k in ("procs", "wall", "busy", "idle", "args", "rc", "tail", "at")}))
        return 0
    seen, t0, (b0, i0) = {}, time.time(), busy_idle()
    sample(seen, {os.getpid()}, first=True)       # what was running already: only its CPU from now on counts
    p = subprocess.Popen([sys.executable, "-m", "pytest", *a.pytest_args], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines = collections.deque(maxlen=5)
    def pump():
        for line in p.stdout:
            sys.stdout.write(line)
            lines.append(line.strip())
    th = threading.Thread(target=pump, daemon=True)
    th.start()
    try:
        while p.poll() is None:
            sample(seen, {os.getpid()})
            time.sleep(0.25)
    except KeyboardInterrupt:
        p.send_signal(signal.SIGINT); p.wait()
    th.join(10)
    (b1, i1), wall = busy_idle(), time.time() - t0
    procs = list(seen.values())
    Path(a.raw).parent.mkdir(exist_ok=True)
    tail = next((l for l in reversed(lines) if " in " in l and ("passed" in l or "failed" in l)), "no summary line")
    run = dict(procs=procs, wall=wall, busy=b1 - b0, idle=i1 - i0, args=a.pytest_args, rc=p.returncode,
               tail=tail.strip("= "), at=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    Path(a.raw).write_text(json.dumps(run))
    Path(a.out).write_text(report(**{k: run[k] for k in ("procs", "wall", "busy", "idle", "args", "rc", "tail", "at")}))
    print(f"wrote {a.out}")
    return p.returncode


if __name__ == "__main__": sys.exit(main())
