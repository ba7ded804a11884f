"""The real `ilab_nb.worker`, with one fault planted for the fault tests (launched as a run's worker module), chosen by
`FAULT_WORKER`:
- `tracker` (the default): rank 0's tracker cannot be opened, as MLflow's cannot on an unwritable tracking URI — a
  failure of rank 0 alone, after which torchrun terminates rank 1 (waiting for it at the rendezvous) with SIGTERM.
- `exit0`: rank `FAULT_RANK` (0 unless set) calls `os._exit(0)` as its first optimizer step begins, as user code may
  (a reward function, a model's remote code): exit code 0, no account of finishing, no `final/`.

The fault is planted when this module is imported, and acts on the rank it names when that rank calls it: the ranks
of a run on several CPU processes are forked from a launcher that imported this module once for all of them
(`ilab_nb.warm_launch`), before any of them had a `RANK`."""
import os

import ilab_nb.worker as W
from ilab_nb.worker import main

_open_trackers, _train_step = W.open_trackers, W.Attempt.train_step


def _unwritable_tracker(writer, run_dir, cfg, rank):
    if rank != 0: return _open_trackers(writer, run_dir, cfg, rank)
    raise FileNotFoundError(2, "No such file or directory", "/nonexistent/mlruns/0/meta.yaml")


def _exit_0_at_the_first_step(self, *args, **kwargs):
    if os.environ.get("RANK", "0") == os.environ.get("FAULT_RANK", "0"): os._exit(0)
    return _train_step(self, *args, **kwargs)


FAULT = os.environ.get("FAULT_WORKER", "tracker")
if FAULT == "tracker": W.open_trackers = _unwritable_tracker
if FAULT == "exit0": W.Attempt.train_step = _exit_0_at_the_first_step

if __name__ == "__main__": main()
