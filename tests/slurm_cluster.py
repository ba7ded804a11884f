"""A real two-node SLURM cluster on this one machine, from Debian's packages (`make slurm-deps`), for the tests.

munged (when none runs), slurmctld and one slurmd per node (`slurmd -N n1`, `slurmd -N n2`), all with state,
spool, pid and log files in a temporary directory and free ports; the nodes share this machine's host name and
address 127.0.0.1, with one CPU each. Everything started here is stopped by pid in `stop()`."""
import os, shutil, signal, socket, subprocess, time
from pathlib import Path

NEEDED = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "sinfo", "scancel")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); return s.getsockname()[1]


def why_not() -> str | None:
    "Why a cluster cannot be started here (None when it can)."
    missing = [c for c in NEEDED if shutil.which(c) is None]
    if missing: return f"SLURM is not installed ({', '.join(missing)} missing): run `make slurm-deps` (as root) to install slurm-wlm and munge"
    if os.geteuid() != 0: return "the test SLURM cluster runs its daemons as root, and these tests do not run as root"
    if not Path("/etc/munge/munge.key").exists(): return "/etc/munge/munge.key is missing (reinstall the munge package)"
    return None


class Cluster:
    "Two SLURM nodes (n1, n2: one CPU each) in partition `debug`, on this machine."
    def __init__(self, base):
        self.dir = Path(base); self.procs = []; self.munged_pid = None
        self.conf = self.dir / "slurm.conf"
        self.env = {"SLURM_CONF": str(self.conf)}

    def _write_conf(self):
        for d in ("state", "spool/n1", "spool/n2", "log"): (self.dir / d).mkdir(parents=True, exist_ok=True)
        host, d = socket.gethostname(), self.dir
        p1, p2 = _free_port(), _free_port()
        self.conf.write_text(f"""ClusterName=ilabnbtest
SlurmctldHost={host}
SlurmctldPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
MpiDefault=none
ReturnToService=1
KillWait=5
NodeName=n1 NodeHostname={host} NodeAddr=127.0.0.1 Port={p1} CPUs=1 State=UNKNOWN
NodeName=n2 NodeHostname={host} NodeAddr=127.0.0.1 Port={p2} CPUs=1 State=UNKNOWN
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP
""")

    def _munge(self):
        if subprocess.run(["munge", "-n"], capture_output=True).returncode == 0: return   # a munged already answers
        Path("/run/munge").mkdir(parents=True, exist_ok=True); shutil.chown("/run/munge", "munge", "munge")
        subprocess.run(["munged", "--force"], check=True, capture_output=True)
        self.munged_pid = int(Path("/run/munge/munged.pid").read_text())

    def start(self, timeout=60) -> "Cluster":
        self._write_conf(); self._munge()
        env = {**os.environ, **self.env}
        log = open(self.dir / "log" / "daemons.out", "ab")
        self.procs.append(subprocess.Popen(["slurmctld", "-D", "-f", str(self.conf)], env=env, stdout=log, stderr=log))
        for n in ("n1", "n2"):
            self.procs.append(subprocess.Popen(["slurmd", "-D", "-N", n, "-f", str(self.conf)], env=env, stdout=log, stderr=log))
        t0 = time.time()
        while time.time() - t0 < timeout:
            r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, env=env)
            states = dict(l.split() for l in r.stdout.splitlines() if l.strip())
            if r.returncode == 0 and states.get("n1") == "idle" and states.get("n2") == "idle": return self
            if any(p.poll() is not None for p in self.procs): break
            time.sleep(0.5)
        tail = "\n".join((self.dir / "log" / f).read_text()[-1500:] for f in ("daemons.out", "slurmctld.log") if (self.dir / "log" / f).exists())
        self.stop()
        raise RuntimeError(f"the test SLURM cluster did not come up within {timeout} s:\n{tail}")

    def stop(self):
        "Stop what start() started, by pid (and the job steps its nodes left behind)."
        self._kill_strays()
        for p in reversed(self.procs):
            if p.poll() is None: p.send_signal(signal.SIGTERM)
        end = time.monotonic() + 5     # a slurmd whose node was set down and back does not always end on SIGTERM: killed
        for p in self.procs:
            try: p.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill(); p.wait()
                with open(self.dir / "log" / "daemons.out", "a") as f: f.write(f"stop: {' '.join(p.args[:4])} killed after SIGTERM\n")
        self.procs = []
        self._kill_strays()
        if self.munged_pid:
            try: os.kill(self.munged_pid, signal.SIGTERM)
            except ProcessLookupError: pass
            # gone before stop() returns: a cluster started next would find it still answering, use it, and lose it
            end = time.monotonic() + 10
            while Path(f"/proc/{self.munged_pid}").exists() and time.monotonic() < end: time.sleep(0.05)
            self.munged_pid = None

    def _kill_strays(self):
        """Kill what this cluster's slurmd left behind: a job step's slurmstepd on a node set down outlives the daemons.
        (Found by the SLURM_CONF in its environment, read from /proc: slurmstepd rewrites the block, and psutil's
        parse of it misses the variable.)"""
        mark = f"\0SLURM_CONF={self.conf}\0".encode()
        for d in Path("/proc").iterdir():
            try:
                if d.name.isdigit() and (d / "comm").read_text().strip() == "slurmstepd" and mark in b"\0" + (d / "environ").read_bytes():
                    os.kill(int(d.name), signal.SIGKILL)
            except OSError: pass

