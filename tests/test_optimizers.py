"""QLoRA with bitsandbytes' 8-bit AdamW, for real, in one shared run: a 4-bit base with LoRA adapters on 2 DDP ranks
keeps its optimizer's moments in bytes in the run's checkpoint (torch's distributed checkpoint, as every optimizer's);
a fork from a checkpoint goes on exactly as the run did, and one onto a single process (accumulating the second
rank's micro-batches) on the same trajectory; `final/` is the adapters merged into the base dequantised. Under FSDP the
4-bit base is whole on each process, or sharded when its storage asks, on the same trajectory; an 8-bit base trains,
checkpoints and merges. (AdamW's fused kernel resumes on FSDP in tests/test_worker.py; the rest: nbs/25_lora,
28_placement and 59_sizes.)"""
import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import fork_here, make_session

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
    same = s.fork(2)         # launched, on 2 ranks as the run; the fork onto 1 process trained here meanwhile
    one, done = fork_here(s, 2, num_processes=1, strategy="single", gradient_accumulation_steps=2)
    assert done == "completed", done
    assert same.wait(timeout=600) == "completed", same.reason
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


def test_qlora_on_fsdp_keeps_the_4bit_base_whole_or_shards_it_as_asked_on_the_same_trajectory(demo, small_train,
                                                                                                runs_root):
    """The same QLoRA run on 2 FSDP ranks twice, side by side: by default each rank holds the 4-bit weights whole (the
    rest sharded); with a float32 `bnb_4bit_quant_storage` (TRL's FSDP-QLoRA recipe) FSDP shards them too, and each
    rank holds about half the base. The losses and the adapters trained are the same to the last bit (2 gloo ranks,
    one thread each, the same batches; and DDP's too: nbs/28_placement, bench/results_qlora_fsdp.md), over 2 steps:
    the second's loss follows the first update, the adapters a second one (from AdamW's moments)."""
    pytest.importorskip("bitsandbytes", reason="QLoRA needs the qlora extra: pip install 'ilab_nb[qlora]'")
    runs = {k: make_session(demo, small_train, runs_root, strategy="fsdp", max_steps=2, save_steps=None, seed=3,
                            lr_scheduler_type="constant", learning_rate=1e-2, lora={"r": 8}, quantization=q)
            for k, q in (("whole", QLORA), ("sharded", {**QLORA, "bnb_4bit_quant_storage": "float32"}))}
    assert {k: s.preflight["memory"]["quantized_base"] for k, s in runs.items()} == \
        {"whole": "whole on each process", "sharded": "sharded"}
    for s in runs.values(): s.start()
    for s in runs.values(): assert s.wait(timeout=600) == "completed", s.reason
    head = {}
    for k, s in runs.items():
        s.monitor.poll()
        head[k] = s.monitor.header
    assert head["sharded"]["load"] == "from_pretrained, quantized by bitsandbytes (4-bit nf4), sharded by FSDP"
    assert head["whole"]["load"].endswith("(4-bit nf4), its quantized weights whole on each process, the rest sharded "
                                          "by FSDP"), head["whole"]["load"]
    total = head["whole"]["params_total"]
    assert head["sharded"]["params_total"] == total and sum(head["sharded"]["params_per_rank"]) == total
    assert max(head["sharded"]["params_per_rank"]) < 0.6 * total < 0.9 * total < min(head["whole"]["params_per_rank"])
    assert losses(runs["sharded"]) == losses(runs["whole"]) and sorted(losses(runs["whole"])) == [1, 2]
    a, b = (load_file(s.run_dir / "final" / "adapter" / "adapter_model.safetensors") for s in runs.values())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_an_8bit_base_trains_checkpoints_its_adapters_alone_and_merges(demo, small_train, runs_root):
    """LLM.int8 (`load_in_8bit`), trained in this process as rank 0 of 1: its checkpoint holds the adapters alone (no
    int8 weight, no row scales: torch's distributed checkpoint cannot map bitsandbytes' `SCB`), and `final/` is the
    adapters merged into the base dequantised, a plain float model. (Its 2-process DDP and FSDP runs, and a fork onto
    one process on the same trajectory: measured by hand, in the note; its layers: nbs/28_placement.)"""
    pytest.importorskip("bitsandbytes", reason="QLoRA needs the qlora extra: pip install 'ilab_nb[qlora]'")
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoModelForCausalLM
    from conftest import train_here
    s = make_session(demo, small_train, runs_root, num_processes=1, strategy="single", max_steps=2, save_steps=2,
                     learning_rate=1e-2, lora={"r": 8}, quantization={"load_in_8bit": True})
    assert train_here(s) == "completed"
    assert losses(s)[2] < losses(s)[1], losses(s)
    meta = FileSystemReader(str(s.run_dir / "checkpoints" / "step-00000002" / "distributed")).read_metadata()
    model_keys = [k for k in meta.state_dict_metadata if k.startswith("model.")]
    assert model_keys and all("lora_" in k for k in model_keys), model_keys
    assert "quantization_config" not in json.loads((s.run_dir / "final" / "config.json").read_text())
    merged = AutoModelForCausalLM.from_pretrained(s.run_dir / "final")
    assert merged.dtype == torch.float32 and (s.run_dir / "final" / "adapter" / "adapter_model.safetensors").is_file()
