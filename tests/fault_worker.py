"""The real `ilab_nb.worker`, with one fault planted for the fault tests (launched as a run's worker module), chosen by
`FAULT_WORKER`:
- `tracker` (the default): rank 0's tracker cannot be opened, as MLflow's cannot on an unwritable tracking URI — a
  failure of rank 0 alone, after which torchrun terminates rank 1 (waiting for it at the rendezvous) with SIGTERM.
- `exit0`: rank `FAULT_RANK` (0 unless set) calls `os._exit(0)` as its first optimizer step begins, as user code may
  (a reward function, a model's remote code): exit code 0, no account of finishing, no `final/`."""
import os

import ilab_nb.worker as W


def _unwritable_tracker(writer, run_dir, cfg, rank):
    raise FileNotFoundError(2, "No such file or directory", "/nonexistent/mlruns/0/meta.yaml")


def _exit_0_at_the_first_step(self, *args, **kwargs):
    os._exit(0)


FAULT, RANK = os.environ.get("FAULT_WORKER", "tracker"), os.environ.get("RANK", "0")
if FAULT == "tracker" and RANK == "0": W.open_trackers = _unwritable_tracker
if FAULT == "exit0" and RANK == os.environ.get("FAULT_RANK", "0"): W.Attempt.train_step = _exit_0_at_the_first_step

if __name__ == "__main__": W.main()
