"""The real `ilab_nb.worker`, each optimizer step followed by a pause (`PACED_WORKER_S` seconds, 1 unless set): for a
test that waits on a clock outside the run (SLURM's time-limit check, every 30 s) while the run trains. The run trains
as it would, one step after another; between steps its ranks sleep, leaving the cores to the suite's other tests
instead of training steps that nothing reads. The pause is planted when this module is imported (once, in the
launcher that forks the ranks: `ilab_nb.warm_launch`), as tests/fault_worker.py plants its faults."""
import os, time

import ilab_nb.worker as W
from ilab_nb.worker import main

_train_step = W.Attempt.train_step


def _paced(self, *args, **kwargs):
    out = _train_step(self, *args, **kwargs)
    time.sleep(float(os.environ.get("PACED_WORKER_S", "1")))
    return out


W.Attempt.train_step = _paced

if __name__ == "__main__": main()
