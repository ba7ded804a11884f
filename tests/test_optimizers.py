"""QLoRA with bitsandbytes' 8-bit AdamW, for real, in one shared run: a 4-bit base with LoRA adapters on 2 DDP ranks
keeps its optimizer's moments in bytes in the run's checkpoint (torch's distributed checkpoint, as every optimizer's);
a fork from a checkpoint goes on exactly as the run did, and one onto a single process (accumulating the second
rank's micro-batches) on the same trajectory; `final/` is the adapters merged into the base dequantised. (AdamW's fused
kernel resumes on FSDP in tests/test_worker.py; the rest: nbs/25_lora, 28_placement and 59_sizes.)"""
import json

import pytest
import torch

from conftest import make_session

pytestmark = pytest.mark.processes

QLORA = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}


def losses(s) -> dict:
    return {r["step"]: r["loss"] for r in s.metrics(as_frame=False) if r["kind"] == "train"}


def test_qlora_with_8bit_adamw_keeps_byte_moments_forks_on_the_same_trajectory_and_merges(demo, small_train, runs_root):
    pytest.importorskip("bitsandbytes", reason="QLoRA and the 8-bit optimizers need the qlora extra: "
                                               "pip install 'ilab_nb[qlora]'")
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoModelForCausalLM
    s = make_session(demo, small_train, runs_root, strategy="ddp", optim="adamw_8bit", max_steps=4, save_steps=2,
                     lr_scheduler_type="constant", seed=3, learning_rate=1e-2, lora={"r": 16}, quantization=QLORA)
    s.start()
    assert s.wait(timeout=600) == "completed", s.reason
    s.monitor.poll()
    head = next(r for r in s.monitor.records if r.get("kind") == "header")
    assert head["load"] == "from_pretrained, quantized by bitsandbytes (4-bit nf4), whole on each process", head["load"]
    same, one = s.fork(2), s.fork(2, num_processes=1, strategy="single", gradient_accumulation_steps=2)
    assert same.wait(timeout=600) == "completed", same.reason
    assert one.wait(timeout=600) == "completed", one.reason
    run, fork, single = losses(s), losses(same), losses(one)
    assert sorted(fork) == [3, 4] and fork == {k: run[k] for k in fork}, (run, fork)   # to the last bit
    assert sorted(single) == [3, 4] and all(abs(single[k] - run[k]) < 1e-4 * abs(run[k]) for k in single), (run, single)
    assert run[4] < run[1]
    meta = FileSystemReader(str(s.run_dir / "checkpoints" / "step-00000002" / "distributed")).read_metadata()
    moments = {k: m.properties.dtype for k, m in meta.state_dict_metadata.items() if k.rsplit(".", 1)[-1] in
               ("state1", "state2")}
    assert torch.uint8 in set(moments.values()), moments    # in bytes (bitsandbytes keeps tensors under 4096 in float32)
    model_keys = [k for k in meta.state_dict_metadata if k.startswith("model.")]
    assert model_keys and all("lora_" in k for k in model_keys), model_keys     # the adapters: no 4-bit base, no scales
    final = s.run_dir / "final"
    assert (final / "adapter" / "adapter_config.json").exists()
    assert "quantization_config" not in json.loads((final / "config.json").read_text())      # plain float weights
    merged = AutoModelForCausalLM.from_pretrained(final)
    base = AutoModelForCausalLM.from_pretrained(demo.model_dir)
    w = "model.layers.0.self_attn.q_proj.weight"
    assert merged.state_dict()[w].dtype == torch.float32 and not torch.equal(merged.state_dict()[w], base.state_dict()[w])
