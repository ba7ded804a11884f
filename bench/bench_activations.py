"""The activations in the memory estimate against what a rank holds, side by side in one run, through FineTuneSession
(the product's own path): bench_lora's ~60M Llama (hidden 768, 8 layers, the demo's tokenizer, random weights), one
CPU process, fp32, the demo rows batched by a token budget of 1,024 and of 4,096 tokens a micro-batch (8,192 and
16,384 with gradient checkpointing), fully fine-tuned and with LoRA r=16, with gradient checkpointing and without: one
run each, 3 steps.

Per run: the largest anonymous resident memory of its rank (RssAnon, read from /proc every 5 ms: what the process
holds of its own, without the model file's pages; glibc's mmap threshold fixed, below, so that freed tensors leave it), and the estimate's activations (`s.preflight["memory"]`, traced
through the model's forward on fake tensors: `ilab_nb.sizes.activation_bytes`). Everything else a rank holds (the
libraries, the weights, gradients and optimizer state) is the same at both budgets, so what the larger budget adds to
the peak is the activations' difference, which the estimate's difference should match: the ratio is the check.

    .venv/bin/python bench/bench_activations.py      # ~25 minutes on 2 cores; writes bench/results_activations.md
"""
import argparse, datetime, os, platform, sys, tempfile, threading, time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT)); sys.path.insert(0, str(ROOT / "bench"))
os.environ["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
# glibc's malloc raises its mmap threshold as large blocks are freed (up to 32 MiB), then serves them from a heap it
# keeps: the resident set would show the heap's high-water mark, not what is live. Fixed at 64 KiB, every tensor larger
# is its own mapping, unmapped when freed (the ranks inherit it).
os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)

from bench_lora import build_model, run
from ilab_nb.demo import demo_assets

MiB = 2**20
# token budgets a micro-batch, two per line: their difference is the activations' (with gradient checkpointing, 4,096
# tokens' peak was the optimizer step's, not the backward pass's: larger ones)
BUDGETS = {False: (1024, 4096), True: (8192, 16384)}


def rss_anon(pid: int) -> int:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("RssAnon:"): return int(line.split()[1]) * 1024
    except OSError: pass
    return 0


class RankPeak(threading.Thread):
    "The largest RssAnon of any rank process whose command line names `marker` (the run's runs root), every 5 ms."
    def __init__(self, marker: str):
        super().__init__(daemon=True); self.marker, self.peak, self.done, self.pids = marker, 0, threading.Event(), set()
    def run(self):
        last = 0.0
        while not self.done.is_set():
            if time.monotonic() - last > 0.5:             # new processes: looked for twice a second
                last = time.monotonic()
                for p in psutil.process_iter(["cmdline"]):
                    c = " ".join(p.info["cmdline"] or [])
                    if "ilab_nb.worker" in c and self.marker in c: self.pids.add(p.pid)
            for pid in list(self.pids): self.peak = max(self.peak, rss_anon(pid))
            time.sleep(0.005)
    def stop(self) -> int:
        self.done.set(); self.join(); return self.peak


def main():
    ap = argparse.ArgumentParser(); ap.add_argument("--no-write", action="store_true"); a = ap.parse_args()
    demo = demo_assets()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        os.environ.setdefault("ILAB_NB_LOCKS", str(root / "locks"))
        model = build_model(root / "model", demo.model_dir)
        base = dict(num_processes=1, strategy="single", device="cpu", precision="fp32", max_steps=3, logging_steps=1,
                    save_steps=None, learning_rate=1e-4, lr_scheduler_type="constant", max_seq_len=256,
                    batching="bucketed", seed=0, merge_lora=False, eval_steps=None)
        for name, extra in (("full fine-tune", {}), ("LoRA r=16", dict(lora={"r": 16, "lora_alpha": 32}))):
            for gc in (False, True):
                got = {}
                for budget in BUDGETS[gc]:
                    runs = root / f"runs-{len(rows)}-{budget}"
                    peak = RankPeak(str(runs)); peak.start()
                    s = run(model, demo.train_file, runs, **base, **extra, gradient_checkpointing=gc,
                            max_tokens_per_batch=budget)
                    got[budget] = dict(peak=peak.stop(), est=s.preflight["memory"]["activations"])
                rows.append(dict(name=name, gc=gc, budgets=BUDGETS[gc], **{f"{k}_{b}": v[k] for b, v in got.items()
                                                                          for k in v}))
                print(rows[-1], flush=True)
    import torch, transformers
    lines = [f"# Activations: the estimate against a rank's peak memory (`bench/bench_activations.py`)", "",
             f"`python bench/bench_activations.py` on {platform.node()} ({os.cpu_count()} CPUs), "
             f"{datetime.date.today()}: bench_lora's ~60M Llama (hidden 768, 8 layers, random weights), 1 CPU process, "
             f"fp32, the demo rows, 3 steps, one run per line and budget; torch {torch.__version__}, transformers "
             f"{transformers.__version__}.", "",
             "| | gradient checkpointing | token budgets | rank's peak anonymous MiB | measured difference MiB | "
             "estimated activations MiB | estimated difference MiB | measured / estimated |",
             "|---|---|---|---|---:|---|---:|---:|"]
    for r in rows:
        b0, b1 = r["budgets"]
        md, ed = (r[f"peak_{b1}"] - r[f"peak_{b0}"]) / MiB, (r[f"est_{b1}"] - r[f"est_{b0}"]) / MiB
        lines.append(f"| {r['name']} | {'yes' if r['gc'] else 'no'} | {b0:,} / {b1:,} | {r[f'peak_{b0}'] / MiB:,.0f} / {r[f'peak_{b1}'] / MiB:,.0f} | {md:+,.0f} | "
                     f"{r[f'est_{b0}'] / MiB:,.0f} / {r[f'est_{b1}'] / MiB:,.0f} | {ed:+,.0f} | {md / ed:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if not a.no_write: (ROOT / "bench" / "results_activations.md").write_text(text)


if __name__ == "__main__":
    main()
