"""glibc's heap and the memory of a QLoRA run on CPU: the same ~1B-shaped run (bench_qlora's --big model and rows,
2 CPU processes, DDP) with glibc's default allocation policy and with `MALLOC_MMAP_THRESHOLD_` fixed, side by side.

By default glibc serves an allocation above its mmap threshold (128 KiB) with its own mapping, returned when freed,
but raises the threshold (up to 32 MiB) each time such a block is freed; after that, the tensors that come and go
(bitsandbytes' float32 copy of each 4-bit weight for a matmul, 20-61 MiB here; the float32 weights read while the base
is quantized) are served from the heap, which keeps what they leave. A fixed threshold keeps every allocation above
it in its own mapping. Each run is one whole `FineTuneSession` run; the variable is set in this process's environment,
which the run's supervisor, launcher and ranks inherit. Per run: the largest anonymous resident memory (RssAnon,
sampled five times a second) of any of the run's processes, the training loop's seconds (the last step's
`elapsed_s`) and the last loss (the allocator must not change it). The two ways alternate, each round in turn order.

    python bench/bench_malloc.py                  # ~12 minutes on 2 cores; writes bench/results_malloc.md
    python bench/bench_malloc.py --rounds 1 --no-write
"""
import argparse, datetime, os, platform, statistics, sys, tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT)); sys.path.insert(0, str(ROOT / "bench"))
os.environ["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")

from bench_lora import build_model
from bench_qlora import PeakAnon
from ilab_nb import FineTuneSession
from ilab_nb.demo import demo_assets
from ilab_nb.sizes import QLORA

THRESHOLD = 4 << 20          # 4 MiB: the ~1B model's activations a layer (1.2 MiB) stay on the heap
WAYS = {"glibc's default": None, f"MALLOC_MMAP_THRESHOLD_={THRESHOLD}": str(THRESHOLD)}
LORA = dict(r=16, lora_alpha=32, target_modules="all-linear")
CHOICES = {"QLoRA r=16 (nf4, double quant)": dict(lora=LORA, quantization=QLORA), "LoRA r=16": dict(lora=LORA)}


def inputs(root: Path, demo) -> tuple[Path, Path]:
    "bench_qlora's ~1B-shaped model and the 16 demo rows, made under `root` (its device locks there too)."
    os.environ.setdefault("ILAB_NB_LOCKS", str(root / "locks"))
    model = build_model(root / "model", demo.model_dir, hidden=2304, layers=14)
    data = root / "train.jsonl"
    data.write_text("".join(open(demo.train_file).readlines()[:16]))
    return model, data


def train(model, data, runs, extra) -> FineTuneSession:
    "The run these benches measure (2 CPU processes, DDP, fp32, one epoch), with `extra` fields, to its end."
    s = FineTuneSession(model=str(model), data=str(data), runs_root=runs, num_processes=2, strategy="ddp", device="cpu",
                        precision="fp32", num_train_epochs=1, logging_steps=1, save_steps=None, learning_rate=1e-3,
                        lr_scheduler_type="constant", max_tokens_per_batch=128, max_seq_len=128, batching="bucketed",
                        seed=0, merge_lora=False, **extra)
    s.start()
    if s.wait() != "completed": raise SystemExit(f"run {s.run_id} ended {s.status}: {s.reason}")
    return s


def one_run(model, data, root, value, extra) -> dict:
    if value is None: os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    else: os.environ["MALLOC_MMAP_THRESHOLD_"] = value
    runs = Path(tempfile.mkdtemp(dir=root, prefix="runs-"))
    peak = PeakAnon(str(runs), every=0.2); peak.start()
    s = train(model, data, runs, extra)
    os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    train = s.metrics(kinds=("train",))
    return dict(peak=peak.stop(), loop=train[-1]["elapsed_s"], loss=train[-1]["loss"], steps=len(train))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the QLoRA pair (LoRA's pair: one round)")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    demo = demo_assets()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model, data = inputs(root, demo)
        for choice, extra in CHOICES.items():
            for r in range(a.rounds if choice.startswith("QLoRA") else 1):
                ways = list(WAYS.items()) if r % 2 == 0 else list(WAYS.items())[::-1]
                for way, value in ways:
                    res = one_run(model, data, root, value, extra)
                    out.setdefault((choice, way), []).append(res)
                    print(choice, way, res, flush=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    lines = ["# glibc's heap and a QLoRA run's memory on CPU (`bench/bench_malloc.py`)", "",
             f"`python bench/bench_malloc.py` on {platform.node()} ({os.cpu_count()} CPUs), {now:%Y-%m-%d %H:%M} UTC: "
             "bench_qlora's ~1B-shaped Llama (hidden 2304 x 14 layers, random weights, the demo's tokenizer), 2 CPU "
             "processes, DDP, fp32, one epoch over 16 demo rows (a budget of 128 tokens a micro-batch), lr 1e-3 "
             "constant; one whole run per cell, the two ways alternating.", "",
             "| run | allocation policy | peak RssAnon MiB, each run | median | training loop s, each run | median | "
             "last loss |", "|---|---|---|---:|---|---:|---:|"]
    med = statistics.median
    for (choice, way), rs in out.items():
        peaks, loops = [r["peak"] for r in rs], [r["loop"] for r in rs]
        lines.append(f"| {choice} | {way} | {', '.join(f'{x:,.0f}' for x in peaks)} | {med(peaks):,.0f} | "
                     f"{', '.join(f'{x:.1f}' for x in loops)} | {med(loops):.1f} | {rs[-1]['loss']:.4f} |")
    lines.append("")
    for choice in CHOICES:
        d, f = (out[(choice, w)] for w in WAYS)
        peak = med(r["peak"] for r in f) / med(r["peak"] for r in d)
        loop = med(r["loop"] for r in f) / med(r["loop"] for r in d)
        lines.append(f"{choice}: the fixed threshold against the default: peak RssAnon x{peak:.2f}, training loop "
                     f"x{loop:.2f}; the same last loss: {len({r['loss'] for r in d + f}) == 1}.")
    text = "\n".join(lines) + "\n"
    print(text)
    if not a.no_write: (ROOT / "bench" / "results_malloc.md").write_text(text)


if __name__ == "__main__": main()
