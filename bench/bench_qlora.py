"""QLoRA beside LoRA and a full fine-tune, and beside TRL's QLoRA, side by side in one run, through FineTuneSession
(the product's own path): the same model (a Llama on the demo's tokenizer, random weights: bench_lora's ~60M shape, or
with --big a ~1B shape, hidden 2304 x 14 layers, where the base's bytes dominate), data, steps and ranks (2 CPU
processes, DDP unless FSDP is named, fp32 compute, one epoch over the same rows), one run each:

- full fine-tune (AdamW; not with --big: 16 bytes a parameter do not fit this machine twice), LoRA r=16 on every linear
  layer, LoRA + 8-bit AdamW, QLoRA (the base 4-bit NF4 with double quantization, bitsandbytes), QLoRA + 8-bit AdamW,
  QLoRA on FSDP, the 4-bit weights whole on each process (the default) and sharded (a float32 storage): their loss
  should be DDP's QLoRA's to the last bit;
- TRL's SFTTrainer on the same model and rows, QLoRA through `model_init_kwargs={"quantization_config": ...}` and a
  peft `LoraConfig`, on two processes as `accelerate launch` runs it.

Per run: rows/s over the training loop (ilab_nb: its `elapsed_s` at the last step; TRL: its `train_runtime`), rank 0's
peak resident set (ru_maxrss: it keeps what the allocator freed, the libraries, and the model file's pages read while
loading, so compare differences), the largest anonymous resident memory (RssAnon, sampled twice a second) of any of
the run's processes: what a rank holds of its own (tensors, the allocator's heap, libraries' data), without the model
file's pages), and the per-rank
training state the memory estimate gives (`ilab_nb.sizes.memory_estimate`: the base, adapters, gradients,
optimizer state, DDP's buckets; no activations) beside it. ilab_nb batches by a token budget per rank and TRL by rows,
so their step counts differ; both see every row once.

    .venv/bin/python bench/bench_qlora.py           # ~5 minutes on 2 cores; writes bench/results_qlora.md
    .venv/bin/python bench/bench_qlora.py --big     # the ~1B shape (~15 minutes); writes bench/results_qlora_1b.md
"""
import argparse, datetime, json, os, platform, statistics, sys, tempfile, textwrap, threading
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT)); sys.path.insert(0, str(ROOT / "bench"))
os.environ["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")

from bench_lora import build_model, run
from _trl import launch_trl
from ilab_nb.demo import demo_assets
from ilab_nb.sizes import QLORA, count_params, memory_estimate

MiB = 2**20
GC_ROW = "QLoRA r=16, gradient checkpointing (TRL's default)"
LORA = {"r": 16, "lora_alpha": 32}

TRL_SCRIPT = textwrap.dedent('''
    import json, resource, sys, torch, datasets
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig
    from trl import SFTConfig, SFTTrainer
    model_dir, data, out, bs, max_len = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    train = datasets.Dataset.from_list([json.loads(l) for l in open(data)])
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                           bnb_4bit_compute_dtype=torch.float32)
    args = SFTConfig(output_dir=out, learning_rate=1e-3, per_device_train_batch_size=bs, num_train_epochs=1,
                     lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, logging_steps=1, report_to=[],
                     use_cpu=True, seed=0, save_strategy="no", max_length=max_len, dataloader_num_workers=0,
                     model_init_kwargs={"quantization_config": q, "dtype": torch.float32})
    tr = SFTTrainer(model=model_dir, args=args, train_dataset=train,
                    peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
    loop = tr.train().metrics["train_runtime"]
    if tr.accelerator.is_main_process:
        logs = [l for l in tr.state.log_history if "loss" in l]
        json.dump(dict(steps=tr.state.global_step, world=tr.accelerator.num_processes, loop=loop,
                       losses=[l["loss"] for l in logs],
                       peak_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024), open(out + "/result.json", "w"))
''')


def rss_anon_mb(pid: int) -> float:
    "The process's anonymous resident memory (`RssAnon` of /proc/PID/status), MiB."
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("RssAnon:"): return int(line.split()[1]) / 1024
    return 0.0


class PeakAnon(threading.Thread):
    """The largest anonymous resident memory (MiB) of any process whose command line holds `marker`, read every
    `every` seconds until `stop`."""
    def __init__(self, marker: str, every: float = 0.5):
        super().__init__(daemon=True)
        self.marker, self.every, self.peak, self.done = marker, every, 0.0, threading.Event()
    def run(self):
        while not self.done.wait(self.every):
            for p in psutil.process_iter(["cmdline"]):
                try:
                    if self.marker in " ".join(p.info["cmdline"] or ()):
                        self.peak = max(self.peak, rss_anon_mb(p.pid))
                except (psutil.Error, OSError): pass
    def stop(self) -> float:
        self.done.set(); self.join(); return self.peak


def run_trl(model, data, root, bs, max_len) -> dict:
    script = root / "trl_qlora.py"; script.write_text(TRL_SCRIPT)
    out = Path(tempfile.mkdtemp(dir=root, prefix="trl-"))
    uss = PeakAnon(str(out)); uss.start()
    _, res = launch_trl(script, [model, data, out, bs, max_len], out)
    return {**res, "uss_mb": uss.stop()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--big", action="store_true", help="the ~1B shape (hidden 2304, 14 layers)")
    ap.add_argument("--rows", type=int, default=None); ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    n = a.rows or (16 if a.big else 256)
    demo = demo_assets()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        os.environ.setdefault("ILAB_NB_LOCKS", str(root / "locks"))
        shape = dict(hidden=2304, layers=14) if a.big else {}      # 12 heads of 192
        model = build_model(root / "model", demo.model_dir, **shape)
        params = count_params(model)
        # the same n rows, once, for both tools; about `per_rank` of them a micro-batch (TRL: exactly)
        per_rank, max_len = (2, 128) if a.big else (8, 128)
        budget = max(per_rank * 32, max_len)
        data = root / "train.jsonl"
        data.write_text("".join(open(demo.train_file).readlines()[:n]))
        base = dict(num_processes=2, strategy="ddp", device="cpu", precision="fp32", num_train_epochs=1, logging_steps=1,
                    save_steps=None, learning_rate=1e-3, lr_scheduler_type="constant", max_tokens_per_batch=budget,
                    max_seq_len=max_len, batching="bucketed", seed=0, merge_lora=False)   # training only
        choices = ([] if a.big else [("full fine-tune", {})]) + [
            ("LoRA r=16", dict(lora=LORA)), ("LoRA r=16 + adamw_8bit", dict(lora=LORA, optim="adamw_8bit")),
            ("QLoRA r=16 (nf4, double quant)", dict(lora=LORA, quantization=QLORA)),
            (GC_ROW, dict(lora=LORA, quantization=QLORA, gradient_checkpointing=True)),
            ("QLoRA r=16 + adamw_8bit", dict(lora=LORA, quantization=QLORA, optim="adamw_8bit")),
            ("QLoRA r=16, FSDP (the 4-bit base whole)", dict(lora=LORA, quantization=QLORA, strategy="fsdp")),
            ("QLoRA r=16, FSDP (the 4-bit base sharded)", dict(lora=LORA, strategy="fsdp",
                                                               quantization={**QLORA, "bnb_4bit_quant_storage": "float32"}))]
        rows = []
        for name, extra in choices:
            runs = root / f"runs-{len(rows)}"
            uss = PeakAnon(str(runs)); uss.start()
            s = run(model, data, runs, **{**base, **extra})
            peak_uss = uss.stop()
            train = s.metrics(kinds=("train",)); head = s.metrics(kinds=("header",))[0]
            lora = head["trainable_params"] if extra.get("lora") else 0
            est = memory_estimate(params, extra.get("strategy", "ddp"), 2, "fp32", adapters=lora,
                                  optim=extra.get("optim", "adamw_torch"), quantized=extra.get("quantization"),
                                  base_sharded="bnb_4bit_quant_storage" in (extra.get("quantization") or {}))
            rows.append(dict(name=name, rows_per_s=n / train[-1]["elapsed_s"], steps=len(train),
                             peak_mb=max(r["peak_mem_mb"] for r in train), uss_mb=peak_uss,
                             est_mb=est["device_bytes"] / MiB,
                             loss=train[-1]["loss"]))
            print(rows[-1], flush=True)
        res = run_trl(model, data, root, per_rank, max_len)
        trl = dict(name="TRL SFTTrainer, QLoRA r=16 (nf4, double quant)", rows_per_s=n / res["loop"], steps=res["steps"],
                   peak_mb=res["peak_mb"], uss_mb=res["uss_mb"], est_mb=None, loss=res["losses"][-1])
        print(trl, flush=True)
    import bitsandbytes, peft, torch, transformers, trl as trl_mod
    ref = next(r for r in rows if r["name"] == "LoRA r=16")
    q = next(r for r in rows if r["name"].startswith("QLoRA r=16 ("))
    g = next(r for r in rows if r["name"] == GC_ROW)          # TRL's configs default gradient_checkpointing=True
    lines = [f"# QLoRA beside LoRA, a full fine-tune and TRL (`bench/bench_qlora.py{' --big' if a.big else ''}`)", "",
             f"`python bench/bench_qlora.py{' --big' if a.big else ''}` on {platform.node()} ({os.cpu_count()} CPUs), "
             f"{datetime.date.today()}: a {params['total'] / 1e6:,.0f}M-parameter Llama (random weights, the demo's "
             f"tokenizer), 2 CPU processes, DDP unless FSDP is named, fp32 compute, one epoch over {n} demo rows (ilab_nb: a budget of "
             f"{budget} tokens a micro-batch; TRL: {per_rank} rows), lr 1e-3 constant, one run per choice; "
             f"torch {torch.__version__}, "
             f"transformers {transformers.__version__}, peft {peft.__version__}, bitsandbytes {bitsandbytes.__version__}, "
             f"trl {trl_mod.__version__}.", "",
             "| | steps | rows/s | x LoRA's | rank 0 peak RSS MiB | - LoRA's | peak anonymous MiB | - LoRA's | x LoRA's | "
             "estimate MiB | - LoRA's | loss at the last step |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows + [trl]:
        est = (f"{r['est_mb']:,.0f} | {r['est_mb'] - ref['est_mb']:+,.0f}" if r["est_mb"] is not None else "- | -")
        lines.append(f"| {r['name']} | {r['steps']} | {r['rows_per_s']:.1f} | {r['rows_per_s'] / ref['rows_per_s']:.2f} | "
                     f"{r['peak_mb']:,.0f} | {r['peak_mb'] - ref['peak_mb']:+,.0f} | {r['uss_mb']:,.0f} | "
                     f"{r['uss_mb'] - ref['uss_mb']:+,.0f} | {r['uss_mb'] / ref['uss_mb']:.2f} | {est} | {r['loss']:.3f} |")
    lines += ["", f"ilab_nb's QLoRA against TRL's, both with gradient checkpointing (TRL's default; ilab_nb's is "
                  f"TrainingArguments' False): rows/s x{g['rows_per_s'] / trl['rows_per_s']:.2f}, rank 0 "
                  f"peak RSS x{g['peak_mb'] / trl['peak_mb']:.2f}, peak anonymous memory x{g['uss_mb'] / trl['uss_mb']:.2f}; "
                  f"without it in ilab_nb: rows/s x{q['rows_per_s'] / trl['rows_per_s']:.2f}, peak anonymous memory "
                  f"x{q['uss_mb'] / trl['uss_mb']:.2f}. "
                  f"QLoRA against LoRA: peak RSS x{q['peak_mb'] / ref['peak_mb']:.2f}, peak anonymous memory "
                  f"x{q['uss_mb'] / ref['uss_mb']:.2f} (the estimate's training state: "
                  f"x{q['est_mb'] / ref['est_mb']:.2f})."]
    text = "\n".join(lines) + "\n"
    print(text)
    if not a.no_write: (ROOT / "bench" / ("results_qlora_1b.md" if a.big else "results_qlora.md")).write_text(text)


if __name__ == "__main__":
    main()
