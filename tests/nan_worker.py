"""The real `ilab_nb.worker`, with one fault planted for the non-finite tests (launched as a run's worker module): the
second optimizer step of each attempt computes its loss times NaN, through the real forward and backward, so its loss
and its gradient norm are NaN on every rank (with NAN_EVERY_STEP set: every step)."""
import dataclasses, os

import ilab_nb.worker as W
from ilab_nb.worker import main

_train_step, _calls = W.Attempt.train_step, [0]


class _NaNTimes:
    "The run's method, its loss multiplied by NaN."
    def __init__(self, method): self.method = method
    def __getattr__(self, name): return getattr(self.method, name)
    def loss_sums(self, forward, batch, split="train"):
        ls, sums = self.method.loss_sums(forward, batch, split)
        return ls * float("nan"), sums


def _nan_on_the_second_step(self, *args, **kwargs):
    _calls[0] += 1
    if _calls[0] == 2 or os.environ.get("NAN_EVERY_STEP"): self = dataclasses.replace(self, method=_NaNTimes(self.method))   # the attempt's method
    return _train_step(self, *args, **kwargs)


W.Attempt.train_step = _nan_on_the_second_step

if __name__ == "__main__": main()
