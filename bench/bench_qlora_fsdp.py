"""QLoRA's 4-bit base whole on each process (DDP; FSDP by default, the rest of the model sharded) against sharded (FSDP
with a float32 `bnb_4bit_quant_storage`, its packed weights too), side by side in one run, through FineTuneSession:
the ~1B shape of `bench_qlora.py --big` (hidden 2304 x 14 layers, random weights, the demo's tokenizer), 2 CPU
processes, fp32 compute, LoRA r=16, the same 16 rows once, 4 steps, lr 1e-3 constant; with gradient clipping
(max_grad_norm 1.0) and without (0), and with gradient checkpointing.

Per run: every step's loss (equal to DDP's to the last bit, or the first step where it parts), the largest anonymous
resident memory (RssAnon, sampled 4 times a second) of either rank over the whole run (its start, which reads the whole
base on each process, included) and during training alone (from the training loop's start), rows/s over the training
loop, and the memory estimate's per-process figure (`ilab_nb.sizes.memory_estimate`).

    .venv/bin/python bench/bench_qlora_fsdp.py      # ~10 minutes on 2 cores; writes bench/results_qlora_fsdp.md
"""
import argparse, datetime, json, os, platform, sys, tempfile, threading, time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT)); sys.path.insert(0, str(ROOT / "bench"))
os.environ["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")

from bench_lora import build_model, run
from bench_qlora import rss_anon_mb
from ilab_nb.demo import demo_assets
from ilab_nb.sizes import QLORA, count_params, memory_estimate

LORA = {"r": 16, "lora_alpha": 32}


class RankMemory(threading.Thread):
    "RssAnon (MiB) of the ranks of the runs under `marker`, with the time of each sample, until `stop`."
    def __init__(self, marker: str):
        super().__init__(daemon=True); self.marker, self.samples, self.done = marker, [], threading.Event()
    def run(self):
        while not self.done.wait(0.25):
            for p in psutil.process_iter(["cmdline"]):
                try:
                    cmd = p.info["cmdline"] or ()
                    if self.marker in " ".join(cmd) and "-m" in cmd and "ilab_nb.worker" in cmd and "accelerate" not in \
                            " ".join(cmd):
                        self.samples.append((time.time(), rss_anon_mb(p.pid)))
                except (psutil.Error, OSError): pass
    def stop(self) -> list:
        self.done.set(); self.join(); return self.samples


def main():
    ap = argparse.ArgumentParser(); ap.add_argument("--no-write", action="store_true"); a = ap.parse_args()
    demo = demo_assets()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        os.environ.setdefault("ILAB_NB_LOCKS", str(root / "locks"))
        model = build_model(root / "model", demo.model_dir, hidden=2304, layers=14)
        params = count_params(model)
        data = root / "train.jsonl"
        data.write_text("".join(open(demo.train_file).readlines()[:16]))
        base = dict(num_processes=2, device="cpu", precision="fp32", num_train_epochs=1, logging_steps=1, save_steps=None,
                    learning_rate=1e-3, lr_scheduler_type="constant", max_tokens_per_batch=128, max_seq_len=128,
                    batching="bucketed", seed=0, merge_lora=False, lora=LORA, quantization=QLORA)
        rows = []
        ways = {"ddp": dict(strategy="ddp"), "fsdp, base whole": dict(strategy="fsdp"),
                "fsdp, base sharded": dict(strategy="fsdp", quantization={**QLORA, "bnb_4bit_quant_storage": "float32"})}
        for mgn, gc in ((1.0, False), (0.0, False), (0.0, True)):
            for strategy, way in ways.items():
                runs = root / f"runs-{len(rows)}"
                mem = RankMemory(str(runs)); mem.start()
                s = run(model, data, runs, **{**base, **way}, gradient_checkpointing=gc, max_grad_norm=mgn)
                samples = mem.stop()
                train = s.metrics(kinds=("train",))
                start = train[0]["time"] - train[0]["elapsed_s"]           # the training loop's start
                est = memory_estimate(params, way["strategy"], 2, "fp32", adapters=s.metrics(kinds=("header",))[0]
                                      ["trainable_params"], quantized=QLORA, base_sharded="sharded" in strategy)
                rows.append(dict(strategy=strategy, gc=gc, mgn=mgn, losses=[r["loss"] for r in train],
                                 peak=max(m for _, m in samples),
                                 train_peak=max((m for t, m in samples if t >= start), default=0.0),
                                 rows_per_s=16 / train[-1]["elapsed_s"], est=est["device_bytes"] / 2**20))
                print({k: v for k, v in rows[-1].items() if k != "losses"}, rows[-1]["losses"][-1], flush=True)
    import bitsandbytes, torch, transformers
    lines = ["# QLoRA's 4-bit base whole on each process or sharded by FSDP (`bench/bench_qlora_fsdp.py`)", "",
             f"`python bench/bench_qlora_fsdp.py` on {platform.node()} ({os.cpu_count()} CPUs), {datetime.date.today()}: a "
             f"{params['total'] / 1e6:,.0f}M-parameter Llama (random weights, the demo's tokenizer), 4-bit NF4 with double "
             f"quantization, LoRA r=16, 2 CPU processes, fp32 compute, 16 demo rows once (4 steps), lr 1e-3 constant, one "
             f"run per line; torch {torch.__version__}, transformers {transformers.__version__}, bitsandbytes "
             f"{bitsandbytes.__version__}.", "",
             "| how | gradient checkpointing | max_grad_norm | losses equal DDP's | peak anonymous MiB (whole run) | "
             "peak anonymous MiB (training) | rows/s | estimate MiB |", "|---|---|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        ddp = next(x for x in rows if x["strategy"] == "ddp" and x["gc"] == r["gc"] and x["mgn"] == r["mgn"])
        part = next((i + 1 for i, (x, y) in enumerate(zip(r["losses"], ddp["losses"])) if x != y), None)
        same = "-" if r is ddp else "every step" if part is None else f"to step {part - 1}, then {r['losses'][-1]!r} " \
               f"against {ddp['losses'][-1]!r} at the last"
        lines.append(f"| {r['strategy']} | {'on' if r['gc'] else 'off'} | {r['mgn']:g} | {same} | {r['peak']:,.0f} | "
                     f"{r['train_peak']:,.0f} | {r['rows_per_s']:.2f} | {r['est']:,.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if not a.no_write: (ROOT / "bench" / "results_qlora_fsdp.md").write_text(text)


if __name__ == "__main__":
    main()
