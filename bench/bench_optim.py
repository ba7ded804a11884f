"""The optimizers `optim` names, side by side in one run, through FineTuneSession (the product's own path): the same
model (a ~60M Llama on the demo's tokenizer, random weights, bench_lora's), data, steps and ranks (2 CPU processes,
DDP, fp32: bitsandbytes' 8-bit AdamW and transformers' Adafactor step whole tensors, not FSDP's shards), one run each.

Per optimizer: tokens/s (median of the train records after the first), rank 0's peak resident set (the process's peak
RSS, which keeps what the allocator freed, with the libraries: compare the differences), the training state the memory
estimate gives each rank (`ilab_nb.sizes.memory_estimate`: fp32 weights, gradients, the optimizer's state, DDP's
buckets), the loss after the last step, and the size of one checkpoint. The estimate's differences between optimizers
are what to read beside the measured ones: the libraries and activations are the same in every run.

    .venv/bin/python bench/bench_optim.py            # ~3 minutes on 2 cores; writes bench/results_optim.md
"""
import argparse, datetime, os, platform, statistics, sys, tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT)); sys.path.insert(0, str(ROOT / "bench"))
os.environ["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")

from bench_lora import build_model, du, run
from ilab_nb.demo import demo_assets
from ilab_nb.rundir import RunPaths
from ilab_nb.sizes import count_params, memory_estimate

OPTIMS = ("adamw_torch", "adamw_torch_fused", "adamw_8bit", "sgd", "adafactor")
MiB = 2**20


def main():
    ap = argparse.ArgumentParser(); ap.add_argument("--steps", type=int, default=8); ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    demo = demo_assets()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_model(root / "model-60m", demo.model_dir)
        params = count_params(model)
        base = dict(num_processes=2, strategy="ddp", device="cpu", precision="fp32", max_steps=a.steps, logging_steps=1,
                    save_steps=a.steps, learning_rate=1e-3, lr_scheduler_type="constant", max_tokens_per_batch=2048,
                    max_seq_len=256, batching="bucketed", seed=0)
        rows = []
        for optim in OPTIMS:
            s = run(model, demo.train_file, root / "runs", **base, optim=optim)
            train = s.metrics(kinds=("train",))
            est = memory_estimate(params, "ddp", 2, "fp32", optim=optim)
            rows.append(dict(optim=optim, tokens_per_s=statistics.median(r["tokens_per_s"] for r in train[1:]),
                             peak_mb=max(r["peak_mem_mb"] for r in train), est_mb=est["device_bytes"] / MiB,
                             loss=train[-1]["loss"], ckpt=du(RunPaths(s.run_dir).checkpoint(a.steps)) / MiB))
            print(rows[-1], flush=True)
    ref = rows[0]
    lines = [f"# The optimizers side by side (`bench/bench_optim.py`)", "",
             f"`python bench/bench_optim.py` on {platform.node()} ({os.cpu_count()} CPUs), {datetime.date.today()}: the "
             f"{params['total'] / 1e6:.0f}M Llama of bench_lora.py, 2 CPU processes, DDP, fp32, {a.steps} steps of the "
             "demo data at a constant learning rate 1e-3, one run per optimizer.", "",
             "| optim | tokens/s | x adamw_torch | rank 0 peak RSS MiB | - adamw_torch's | estimate MiB | - adamw_torch's "
             "| loss at the last step | checkpoint MiB |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['optim']} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / ref['tokens_per_s']:.2f} | "
                     f"{r['peak_mb']:.0f} | {r['peak_mb'] - ref['peak_mb']:+.0f} | {r['est_mb']:.0f} | "
                     f"{r['est_mb'] - ref['est_mb']:+.0f} | {r['loss']:.3f} | {r['ckpt']:.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if not a.no_write: (ROOT / "bench" / "results_optim.md").write_text(text)


if __name__ == "__main__":
    main()
