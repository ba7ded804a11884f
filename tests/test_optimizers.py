"""The optimizers `optim` names, for real: bitsandbytes' 8-bit AdamW on 2 DDP ranks keeps its moments in bytes in the
run's checkpoint (torch's distributed checkpoint, as every optimizer's), and a fork from a checkpoint goes on exactly
as the run did. (AdamW's fused kernel resumes on FSDP in tests/test_worker.py; the rest: nbs/28_placement.ipynb.)"""
import pytest
import torch

from conftest import make_session

pytestmark = pytest.mark.processes


def losses(s) -> dict:
    return {r["step"]: r["loss"] for r in s.metrics(as_frame=False) if r["kind"] == "train"}


def test_8bit_adamw_keeps_byte_moments_in_its_checkpoint_and_a_fork_goes_on_the_same_trajectory(demo, small_train,
                                                                                              runs_root):
    pytest.importorskip("bitsandbytes", reason="the 8-bit optimizers need the qlora extra: pip install 'ilab_nb[qlora]'")
    from torch.distributed.checkpoint import FileSystemReader
    s = make_session(demo, small_train, runs_root, strategy="ddp", optim="adamw_8bit", max_steps=4, save_steps=2,
                     lr_scheduler_type="constant", seed=3)
    s.start()
    assert s.wait(timeout=600) == "completed", s.reason
    f = s.fork(2)
    assert f.wait(timeout=600) == "completed", f.reason
    run, fork = losses(s), losses(f)
    assert sorted(fork) == [3, 4] and fork == {k: run[k] for k in fork}, (run, fork)   # to the last bit
    assert run[4] < run[1]
    meta = FileSystemReader(str(s.run_dir / "checkpoints" / "step-00000002" / "distributed")).read_metadata()
    moments = {k: m.properties.dtype for k, m in meta.state_dict_metadata.items() if k.rsplit(".", 1)[-1] in
               ("state1", "state2")}
    assert moments and torch.uint8 in set(moments.values()), moments          # the weight matrices' moments, in bytes
