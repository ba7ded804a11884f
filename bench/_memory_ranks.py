"""One rank of bench/bench_memory.py (run under torchrun): load a model the old way (`--path before`: from_pretrained
on every rank, then fully_shard, loss over full float32 logits) or the new way (`--path after`: meta device,
fully_shard, sharded read of the safetensors files, chunked loss), take one optimizer step, and report this rank's
host memory: peak resident set (VmHWM) and peak anonymous memory (sampled), at load and over the first step."""
import argparse, json, os, sys, threading, time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ilab_nb import batching as B, worker as W
from ilab_nb.config import TrainConfig


def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"): return int(line.split()[1]) * 1024
    return 0


class AnonPeak:
    "Peak anonymous resident memory (RssAnon), sampled every 2 ms: memory this process owns, not mapped file pages."
    def __init__(self):
        self.peak, self.stop = status("RssAnon"), False
        self.t = threading.Thread(target=self._run, daemon=True); self.t.start()
    def _run(self):
        while not self.stop:
            self.peak = max(self.peak, status("RssAnon")); time.sleep(0.002)
    def reset(self): self.peak = status("RssAnon")


def trim():
    "Hand freed heap memory back to the system (glibc malloc_trim), so the resident set shows what is still held."
    import ctypes
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def reset_hwm():
    "Reset VmHWM to the current RSS (Linux: write 5 to clear_refs)."
    with open("/proc/self/clear_refs", "w") as f: f.write("5")


def old_path(model_dir, world):
    "The path before sharded loading (kept here, not in the library): from_pretrained on every rank, then fully_shard."
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    m.config.use_cache = False
    mesh = init_device_mesh("cpu", (world,))
    for block in m.model.layers: fully_shard(block, mesh=mesh)
    return fully_shard(m, mesh=mesh)


p = argparse.ArgumentParser(); p.add_argument("model"); p.add_argument("--path", choices=["before", "after"]); p.add_argument("--out")
a = p.parse_args()
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
env = W.DistEnv(rank=rank, world_size=world, backend="gloo")
cfg = TrainConfig(model=a.model, data=["unused"], device="cpu", num_processes=world)
import transformers, accelerate  # noqa: F401  (libraries imported before the baseline, as in the worker)
dist.barrier()
base_rss, base_anon = status("VmRSS"), status("RssAnon")
reset_hwm(); anon = AnonPeak()
t0 = time.time()
if a.path == "before":
    model = old_path(a.model, world)
else:
    model, _ = W.setup_model(cfg, env, "bucketed")
dist.barrier(); trim()
load = dict(hwm=status("VmHWM") - base_rss, anon_peak=anon.peak - base_anon, rss_after=status("VmRSS") - base_rss, s=time.time() - t0)

opt = W.make_optimizer(model, cfg)
g = torch.Generator().manual_seed(rank)
ids = torch.randint(3, 30000, (256,), generator=g).tolist()
batch = B.collate([dict(input_ids=ids, labels=ids)], "bucketed", 0)
reset_hwm(); anon.reset(); t0 = time.time()
if a.path == "before":
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    loss = B.token_loss_sum(logits.float(), batch["labels"])
else:
    loss = W._forward_loss_sum(model, batch, env, nullcontext)
loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
dist.barrier(); trim()
step = dict(hwm=status("VmHWM") - base_rss, anon_peak=anon.peak - base_anon, rss_after=status("VmRSS") - base_rss, s=time.time() - t0)
anon.stop = True
res = [None] * world
dist.all_gather_object(res, dict(rank=rank, load=load, step=step, params_local=W.local_param_count(model)))
if rank == 0: Path(a.out).write_text(json.dumps(res))
dist.barrier(); dist.destroy_process_group()
