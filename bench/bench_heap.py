"""What a CPU rank uses against what it holds: the preflight's per-process estimate beside the bytes glibc's allocator
has handed out (in use) and the anonymous memory the kernel gives the process (RssAnon), both at their peaks over the
rank's set-up and training, above what the rank held as it started (its imports, before the model). The same ~1B-shaped
run as bench_malloc (bench_qlora's --big model, 2 CPU processes, DDP, fp32, 16 demo rows, 128 tokens a micro-batch),
QLoRA and LoRA, each rank watched by bench/heap_worker.py (the real worker and a thread). glibc only.

    python bench/bench_heap.py                # ~5 minutes on 2 cores; writes bench/results_heap.md
    python bench/bench_heap.py --no-write
"""
import argparse, datetime, json, os, platform, sys, tempfile
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT)); sys.path.insert(0, str(ROOT / "bench"))
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "bench"), os.environ.get("PYTHONPATH", "")])

import ilab_nb.session as session_mod
from bench_malloc import CHOICES, inputs, train
from ilab_nb.demo import demo_assets

MiB = 2**20


def one_run(model, data, root, extra) -> dict:
    s = train(model, data, Path(tempfile.mkdtemp(dir=root, prefix="runs-")), extra)
    ranks = [json.loads((Path(s.run_dir) / f"heap-rank-{r}.json").read_text()) for r in range(2)]
    return dict(estimate=s.preflight["memory"]["device_bytes"] / MiB, ranks=ranks,
                loss=s.metrics(kinds=("train",))[-1]["loss"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    session_mod.spawn_supervisor = partial(session_mod.spawn_supervisor, worker_module="heap_worker")
    demo = demo_assets()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        model, data = inputs(Path(tmp), demo)
        for choice, extra in CHOICES.items():
            out[choice] = one_run(model, data, Path(tmp), extra)
            print(choice, out[choice], flush=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    lines = ["# What a CPU rank uses and what it holds, beside the estimate (`bench/bench_heap.py`)", "",
             f"`python bench/bench_heap.py` on {platform.node()} ({os.cpu_count()} CPUs), {now:%Y-%m-%d %H:%M} UTC: "
             "bench_qlora's ~1B-shaped Llama (hidden 2304 x 14 layers, random weights, the demo's tokenizer), 2 CPU "
             "processes, DDP, fp32, one epoch over 16 demo rows (128 tokens a micro-batch), lr 1e-3 constant; one run "
             "each. MiB; peaks over the rank's set-up and training, above what it held as it started (after its "
             "imports, before its model). In use: glibc's `mallinfo2` (chunks handed out and not freed, and blocks "
             "mapped on their own); held: `RssAnon`.", "",
             "| run | rank | estimate a process | peak in use | in use / estimate | peak held (RssAnon) | "
             "held / estimate | held / in use |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for choice, r in out.items():
        for k, rk in enumerate(r["ranks"]):
            use, held = rk["peak_in_use"] - rk["base_in_use"], rk["peak_anon"] - rk["base_anon"]
            lines.append(f"| {choice} | {k} | {r['estimate']:,.0f} | {use:,.0f} | {use / r['estimate']:.2f} | "
                         f"{held:,.0f} | {held / r['estimate']:.2f} | {held / use:.2f} |")
    lines += ["", "At the start (after the imports): " + "; ".join(
        f"{c} rank {k} in use {rk['base_in_use']:,.0f}, held {rk['base_anon']:,.0f}"
        for c, r in out.items() for k, rk in enumerate(r["ranks"])) + "."]
    text = "\n".join(lines) + "\n"
    print(text)
    if not a.no_write: (ROOT / "bench" / "results_heap.md").write_text(text)


if __name__ == "__main__": main()
