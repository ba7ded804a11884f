"""Run by tests/test_sizes.py under torchrun (2 gloo ranks): one training step's loss and gradients through a
reference kept here (from_pretrained on every rank, fully_shard, full float32 logits) and the worker's set-up
(`setup_model`: meta device, fully_shard, sharded read, chunked loss), then the worker's sharded Hugging Face save.
Rank 0 writes what it saw to a JSON file."""
import json, sys
from pathlib import Path

import torch
import torch.distributed as dist

from ilab_nb import batching as B, checkpoints as C, worker as W
from ilab_nb.config import TrainConfig

model_dir, tok_dir, out_json, out_hf = map(Path, sys.argv[1:5])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
env = W.DistEnv(rank=rank, world_size=world, backend="gloo")
cfg = TrainConfig(model=str(model_dir), data=["unused"], device="cpu", num_processes=world)

g = torch.Generator().manual_seed(rank)                 # each rank its own batch, as in training
samples = [dict(input_ids=(ids := torch.randint(3, 100, (n,), generator=g).tolist()), labels=[-100] * 3 + ids[3:])
           for n in (17, 9, 30)]
batch = B.collate(samples, "bucketed", pad_id=0)

def step(model, loss_fn):
    loss = loss_fn(model)
    loss.backward()
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone() for n, p in model.named_parameters()}
    total = loss.detach().clone(); dist.all_reduce(total)
    return float(total), grads

def old_path(model_dir):
    "The reference: every rank loads the whole float32 model with from_pretrained, then fully_shard per block and the root."
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    m.config.use_cache = False
    mesh = init_device_mesh("cpu", (world,))
    for block in m.model.layers: fully_shard(block, mesh=mesh)
    return fully_shard(m, mesh=mesh)

old = old_path(model_dir)
def old_loss(m):
    logits = m(input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    return B.token_loss_sum(logits.float(), batch["labels"])
loss_old, grads_old = step(old, old_loss)

new, info = W.setup_model(cfg, env, "bucketed")
loss_new, grads_new = step(new, lambda m: W._forward_loss_sum(m, batch, env, __import__("contextlib").nullcontext))
tied = new.lm_head.weight is new.model.embed_tokens.weight
inv_freq_equal = torch.equal(new.model.rotary_emb.inv_freq, old.model.rotary_emb.inv_freq)

from transformers import AutoTokenizer
C.save_hf(new, AutoTokenizer.from_pretrained(tok_dir), out_hf, env)
from torch.distributed.checkpoint.state_dict import get_model_state_dict, StateDictOptions
full_new = get_model_state_dict(new, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
if rank == 0:
    rel = {n: float((grads_new[n] - grads_old[n]).norm() / grads_old[n].norm().clamp_min(1e-30)) for n in grads_old}
    json.dump(dict(loss_old=loss_old, loss_new=loss_new, grad_rel_err=rel, tied=tied, inv_freq_equal=inv_freq_equal,
                   info=info, params_local=W.local_param_count(new), params_total=sum(p.numel() for p in new.parameters())),
              open(out_json, "w"))
    torch.save({k: v for k, v in full_new.items()}, out_json.with_suffix(".pt"))
dist.barrier(); dist.destroy_process_group()
