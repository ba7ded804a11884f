"""Training throughput of a ~1B-parameter Llama (built locally, random weights: no download) on every local CUDA
device: FSDP2, bf16 mixed precision (bf16 compute, fp32 master weights and reductions), chunked loss, packed rows
under torch's variable-length attention vs length-bucketed padded batches, at a 4,096-token budget per device.
Prints tokens/s, MFU (with its formula) and peak device memory, and writes a markdown table.

    python bench/bench_gpu.py                 # on a CUDA machine: all local GPUs; writes bench/results_gpu.md
    python bench/bench_gpu.py --tiny          # CPU smoke run (2 gloo ranks, tiny model, fp32): keeps the script alive

MFU = (6 N + 12 L d s) x tokens/s / (devices x peak dense bf16 FLOP/s), with N the parameters in the matrix
products of one token (every parameter but the input embedding's lookup; the output layer counted even where it is
tied to the input embedding, as in this bench's model), L layers, d hidden size and s the mean length of the
sequences attended over (the PaLM appendix B count: 6N for the matrix products forward and backward, 12 L d s for
attention scores and values).
"""
import argparse, datetime, json, os, sys, tempfile, time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Dense bf16 tensor-core peaks from the vendor's data sheets (the sparse figures are twice these). The longest name
# that the device's name contains wins: "NVIDIA H200 NVL" is an H200 NVL (835), "NVIDIA H200" an SXM one (989).
PEAK_BF16 = {"H200 NVL": 835e12, "H200": 989e12, "GH200": 989e12, "H100 NVL": 835e12, "H100 PCIe": 756e12,
             "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12, "L4": 121e12}


def peak_for(name):
    "The dense bf16 peak of the GPU called `name` (torch.cuda.get_device_name), or None if unknown."
    hits = [k for k in PEAK_BF16 if k in name]
    return PEAK_BF16[max(hits, key=len)] if hits else None


def matmul_params(model):
    "Parameters in one token's matrix products: all but the input embedding (a lookup); a tied output layer counts."
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    total = sum(p.numel() for p in model.parameters())          # a tied weight is one parameter, counted once
    return total - emb.numel() + (head.numel() if head is emb else 0)


def flops_per_token(n_matmul, layers, hidden, s_mean):
    "Training FLOPs per token (forward and backward): 6 N for the matrix products, 12 L d s for attention."
    return 6 * n_matmul + 12 * layers * hidden * s_mean


def shapes(tiny):
    if tiny: return dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    return dict(vocab_size=128256, hidden_size=2048, num_hidden_layers=16, intermediate_size=8192, num_attention_heads=32,
                num_key_value_heads=8)                 # Llama 3.2 1B's shape: 1.24B parameters with tied embeddings


def lengths(n, seed, hi):
    return np.clip(np.random.default_rng(seed).lognormal(6.0, 0.8, n), 16, hi).astype(int).tolist()


def peak_flops(tiny):
    if tiny or not torch.cuda.is_available(): return 1e12, "CPU: no meaningful peak, 1 TFLOP/s assumed"
    name = torch.cuda.get_device_name()
    if os.environ.get("PEAK_TFLOPS"): return float(os.environ["PEAK_TFLOPS"]) * 1e12, f"{name}: PEAK_TFLOPS={os.environ['PEAK_TFLOPS']}"
    v = peak_for(name)
    if v: return v, f"{name}: {v / 1e12:.0f} TFLOP/s dense bf16"
    return 1e12, f"{name}: unknown peak (set PEAK_TFLOPS)"


def rank_main(a):
    import torch.distributed as dist
    from ilab_nb import batching as B, worker as W
    from ilab_nb.config import TrainConfig
    cuda = torch.cuda.is_available() and not a.tiny
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", 0))
    if cuda: torch.cuda.set_device(local)
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    env = W.DistEnv(rank=rank, local_rank=local, world_size=world, backend=dist.get_backend(), device=device, device_type=device.type)
    sh = shapes(a.tiny)
    model_dir = Path(a.model_dir)
    if rank == 0 and not (model_dir / "config.json").exists():
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**sh, tie_word_embeddings=True, max_position_embeddings=8192)).to(torch.bfloat16).save_pretrained(model_dir)
    dist.barrier()
    budget = a.tokens
    lens = lengths(a.samples, 0, min(budget, 2048))
    g = torch.Generator().manual_seed(0)
    samples = [dict(input_ids=(ids := torch.randint(3, sh["vocab_size"], (n,), generator=g).tolist()), labels=ids) for n in lens]
    peak, peak_note = peak_flops(a.tiny)
    L, d = sh["num_hidden_layers"], sh["hidden_size"]
    rows = []
    for layout in ("packed", "bucketed"):
        cfg = TrainConfig(model=str(model_dir), data=["unused"], device=device.type, num_processes=world, strategy="fsdp",
                          precision="bf16" if cuda else "fp32", batching=layout, max_tokens_per_batch=budget, max_seq_len=min(budget, 2048))
        model, info = W.setup_model(cfg, env, layout)
        N = matmul_params(model)
        opt = W.make_optimizer(model, cfg)
        plan = B.plan_epoch(lens, budget, world, layout, seed=0, epoch=0)[: a.steps + a.warmup]
        if cuda: torch.cuda.reset_peak_memory_stats(); torch.cuda.synchronize()
        tok = attended = 0; t0 = None
        for k, ms in enumerate(plan):
            if k == a.warmup:
                if cuda: torch.cuda.synchronize()
                dist.barrier(); t0 = time.perf_counter(); tok = attended = 0
            batch = B.collate([samples[i] for i in ms[rank]], layout, 0)
            loss = W._forward_loss_sum(model, batch, env, nullcontext) / max(int(batch["num_loss_tokens"]), 1)
            loss.backward(); torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); opt.step(); opt.zero_grad(set_to_none=True)
            tok += sum(lens[i] for r in ms for i in r); attended += sum(n * n for r in ms for n in [lens[i] for i in r])
        if cuda: torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        s_mean = attended / max(tok, 1)                      # token-weighted mean sequence length
        fpt = flops_per_token(N, L, d, s_mean)
        tps = tok / dt
        mem = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan")
        mems = [None] * world; dist.all_gather_object(mems, mem)
        rows.append(dict(layout=layout, attn=model.config._attn_implementation, tokens_per_s=tps, mfu=fpt * tps / (world * peak),
                         flops_per_token=fpt, N=N, s_mean=s_mean, peak_mem_gib=max(mems), steps=len(plan) - a.warmup,
                         load=info["load"], mixed_precision=info["mixed_precision"]))
        del model, opt
        if cuda: torch.cuda.empty_cache()
    if rank == 0:
        dev = torch.cuda.get_device_name() if cuda else "CPU (--tiny)"
        head = (f"# Training throughput, {'tiny Llama on CPU (smoke run)' if a.tiny else '~1B Llama'}, FSDP2\n\n"
                f"`python bench/bench_gpu.py{' --tiny' if a.tiny else ''}`, {datetime.date.today()}, {world} x {dev}, torch {torch.__version__}, "
                f"token budget {budget} per device per micro-batch, {rows[0]['steps']} timed steps after {a.warmup} warm-up.\n\n"
                f"MFU = (6 N + 12 L d s) x tokens/s / ({world} x peak); N = {rows[0]['N']:,} parameters in the matrix products "
                f"(the tied output layer included, the input embedding's lookup not), "
                f"L = {L}, d = {d}, s = token-weighted mean sequence length; peak: {peak_note}.\n\n"
                "| layout | attention | tokens/s | MFU | FLOPs/token | s | peak device memory GiB | load | mixed precision |\n|---|---|---|---|---|---|---|---|---|\n")
        text = head + "\n".join(f"| {r['layout']} | {r['attn']} | {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f} % | {r['flops_per_token']:.3g} | "
                                f"{r['s_mean']:.0f} | {r['peak_mem_gib']:.1f} | {r['load']} | {r['mixed_precision']} |" for r in rows) + "\n"
        print(text)
        Path(a.out).write_text(text)
    dist.barrier(); dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true"); ap.add_argument("--out", default=None)
    ap.add_argument("--tokens", type=int, default=None); ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None); ap.add_argument("--samples", type=int, default=None)
    ap.add_argument("--model-dir", default=None); ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.tokens = a.tokens or (256 if a.tiny else 4096); a.steps = a.steps or (3 if a.tiny else 30)
    a.warmup = a.warmup if a.warmup is not None else (1 if a.tiny else 5); a.samples = a.samples or (60 if a.tiny else 4000)
    a.out = a.out or str(ROOT / "bench" / ("results_gpu_tiny.md" if a.tiny else "results_gpu.md"))
    if a.rank: return rank_main(a)
    import subprocess
    n = 2 if a.tiny or not torch.cuda.is_available() else torch.cuda.device_count()   # queried here, in the parent only
    with tempfile.TemporaryDirectory() as tmp:
        a.model_dir = a.model_dir or str(Path(tmp) / "model")
        from ilab_nb.launcher import free_port
        cmd = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", str(n), "--master_port", str(free_port()),
               "--log-dir", str(Path(tmp) / "torchelastic"), __file__, "--rank",
               "--tokens", str(a.tokens), "--steps", str(a.steps), "--warmup", str(a.warmup), "--samples", str(a.samples),
               "--model-dir", a.model_dir, "--out", a.out] + (["--tiny"] if a.tiny else [])
        sys.exit(subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}).returncode)


if __name__ == "__main__":
    main()
