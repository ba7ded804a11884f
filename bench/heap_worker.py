"""The real `ilab_nb.worker`, each rank watched by a thread that reads two figures a hundred times a second: the
rank's anonymous resident memory (`RssAnon`, what the kernel gives it) and the bytes glibc's allocator has handed out
and not had back (`mallinfo2().uordblks`, what the process uses of it). Both are read once as the rank starts, after
its imports and before its model (the baseline), and their peaks over the rank's set-up and training are written to
`<run dir>/heap-rank-N.json` after each optimizer step. For `bench_heap.py`, given to the runs as tests/paced_worker.py
is given to the SLURM test: through the supervisor's `worker_module`, its folder on `PYTHONPATH`. glibc only."""
import ctypes, json, os, threading, time

import ilab_nb.worker as W
from ilab_nb.worker import main as _main


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                                "uordblks", "fordblks", "keepcost")]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _Mallinfo2
MiB = 2**20


def rss_anon() -> float:
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("RssAnon:")) / MiB


def in_use() -> float:
    m = _libc.mallinfo2()
    return (m.uordblks + m.hblkhd) / MiB          # the heap's chunks in use and the blocks mapped on their own


_seen = {}


def _watch():
    while True:
        _seen["peak_anon"] = max(_seen.get("peak_anon", 0), rss_anon())
        _seen["peak_in_use"] = max(_seen.get("peak_in_use", 0), in_use())
        time.sleep(0.01)


_train_step = W.Attempt.train_step


def _step_then_write(self, *args, **kwargs):
    out = _train_step(self, *args, **kwargs)
    (self.paths.root / f"heap-rank-{self.env.rank}.json").write_text(json.dumps(_seen))
    return out


W.Attempt.train_step = _step_then_write


def main(argv=None, leave=os._exit):
    "The worker's `main`, the watching thread started first (in a forked rank: in the rank, not its launcher)."
    _seen.update(base_anon=rss_anon(), base_in_use=in_use())
    threading.Thread(target=_watch, daemon=True).start()
    return _main(argv, leave=leave)


if __name__ == "__main__": main()
