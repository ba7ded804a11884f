"""The real `ilab_nb.worker`, with one fault planted for the fault tests (launched as a run's worker module): rank 0's
tracker cannot be opened, as MLflow's cannot on an unwritable tracking URI — a failure of rank 0 alone, after which
torchrun terminates rank 1 (waiting for it at the rendezvous) with SIGTERM."""
import os

import ilab_nb.worker as W


def _unwritable_tracker(writer, run_dir, cfg, rank):
    raise FileNotFoundError(2, "No such file or directory", "/nonexistent/mlruns/0/meta.yaml")


if os.environ.get("RANK") == "0": W.open_trackers = _unwritable_tracker

if __name__ == "__main__": W.main()
