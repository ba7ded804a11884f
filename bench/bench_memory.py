"""Host memory of each of 2 CPU ranks (gloo, FSDP2) when loading a Llama and over its first optimizer step, with the
old loading path (every rank `from_pretrained`s the whole float32 model, then `fully_shard`; loss over full float32
logits) and the new one (meta device, `fully_shard`, each rank reads its slices of the safetensors files; chunked
loss). Models are built locally (random weights, saved in bfloat16 like most published checkpoints).

    .venv/bin/python bench/bench_memory.py                      # 50M, 200M, 600M; writes bench/results_memory.md
    .venv/bin/python bench/bench_memory.py --sizes 50M --no-write

Figures per rank, in MiB above the rank's resident memory just before loading (libraries imported):
  hwm   peak resident set (VmHWM): includes pages of the safetensors files mapped while reading them, which are
        page cache shared between ranks and reclaimable, not memory the rank owns;
  anon  peak anonymous memory (RssAnon, sampled every 2 ms): what the rank itself allocated.
"after step RSS" is the resident set after the step once freed heap memory is handed back (malloc_trim).
The sharded arithmetic for the first step (ilab_nb.sizes.memory_estimate): float32 weights, gradients and AdamW's
two moments, 16 bytes per parameter / world size, plus the gathered root (embeddings, head) and two blocks.
"""
import argparse, datetime, json, os, platform, subprocess, sys, tempfile
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from ilab_nb.sizes import count_params, memory_estimate
from ilab_nb.launcher import free_port

SIZES = {   # hidden, layers, intermediate, key/value heads (vocab 32000, tied embeddings, heads of 64)
    "50M": (640, 8, 1792, 5), "200M": (1024, 12, 2816, 4), "600M": (1536, 20, 4096, 8)}
MiB = 2**20


def build(size, d):
    h, L, i, kv = SIZES[size]
    cfg = LlamaConfig(vocab_size=32000, hidden_size=h, num_hidden_layers=L, intermediate_size=i, num_attention_heads=h // 64,
                      num_key_value_heads=kv, tie_word_embeddings=True, max_position_embeddings=2048)
    with torch.device("cpu"):
        m = LlamaForCausalLM(cfg).to(torch.bfloat16)
    m.save_pretrained(d); del m
    return count_params(d)


def run(model_dir, path, tmp):
    out = Path(tmp) / f"{path}.json"
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()),
           "--log-dir", str(Path(tmp) / "torchelastic"), str(ROOT / "bench" / "_memory_ranks.py"), str(model_dir),
           "--path", path, "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if r.returncode: raise SystemExit(f"{path} failed:\n{r.stderr[-3000:]}")
    return json.loads(out.read_text())


def main():
    ap = argparse.ArgumentParser(); ap.add_argument("--sizes", default="50M,200M,600M"); ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--from-log", help="write the table from the JSON rows a run printed (an interrupted run's log)")
    a = ap.parse_args()
    rows = [json.loads(l) for l in open(a.from_log) if l.startswith("{")] if a.from_log else []
    if a.from_log: a.sizes = ",".join(dict.fromkeys(r["size"] for r in rows))
    for size in ([] if a.from_log else a.sizes.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            params = build(size, Path(tmp) / "model")
            full = 4 * params["total"]
            est = memory_estimate(params, "fsdp", 2, "fp32")
            for path in ("before", "after"):
                for r in run(Path(tmp) / "model", path, tmp):
                    row = dict(size=size, params=params["total"], full_fp32_mib=full / MiB, path=path, rank=r["rank"],
                               load_hwm=r["load"]["hwm"] / MiB, load_anon=r["load"]["anon_peak"] / MiB, load_s=r["load"]["s"],
                               step_hwm=r["step"]["hwm"] / MiB, step_anon=r["step"]["anon_peak"] / MiB,
                               after_step=r["step"]["rss_after"] / MiB, estimate=est["device_bytes"] / MiB)
                    rows.append(row); print(json.dumps(row), flush=True)
    head = ("| model | params | full fp32 MiB | path | rank | load: peak RSS | load: peak anon | load anon / full fp32 | load s | "
            "step: peak RSS | step: peak anon | sharded estimate | step peak anon / estimate | held after step |\n|" + "---|" * 14)
    lines = [f"| {r['size']} | {r['params'] / 1e6:.0f}M | {r['full_fp32_mib']:.0f} | {r['path']} | {r['rank']} | {r['load_hwm']:.0f} | "
             f"{r['load_anon']:.0f} | {r['load_anon'] / r['full_fp32_mib']:.2f} | {r['load_s']:.1f} | {r['step_hwm']:.0f} | {r['step_anon']:.0f} | "
             f"{r['estimate']:.0f} | {r['step_anon'] / r['estimate']:.2f} | {r['after_step']:.0f} |" for r in rows]
    text = (f"# Host memory per rank: loading and first step, before/after sharded loading\n\n"
            f"`python bench/bench_memory.py --sizes {a.sizes}` on {platform.node()} ({os.cpu_count()} CPUs), "
            f"torch {torch.__version__}, {datetime.date.today()}; 2 ranks, gloo, FSDP2, fp32 training, 256-token batch.\n"
            "MiB above each rank's resident memory just before loading. See the docstring of bench_memory.py for the columns.\n\n"
            + head + "\n" + "\n".join(lines) + "\n")
    print(text)
    if not a.no_write: (ROOT / "bench" / "results_memory.md").write_text(text)


if __name__ == "__main__":
    main()
