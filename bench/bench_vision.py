"""Vision SFT through ilab_nb against TRL's SFTTrainer, side by side in one run: the vision demo's tiny LLaVA (a CLIP
tower, its projector, the demo's Llama; nbs/45_vision_demo) on its colour questions, --epochs epochs, every part trained
(TRL trains every weight; ilab_nb's freeze_* defaults are turned off to match), the loss on the assistant's answer
alone (TRL: assistant_only_loss=True, the same {% generation %} marks), the same learning rate and optimizer, 2 CPU
processes each, data parallel (ilab_nb strategy="ddp"; TRL under `accelerate launch`, as its docs run it).

Timed: the whole command's wall time (model and processor load, data preparation, the steps, the final save) and the
questions trained per second of it; each pair of commands runs --rounds times, alternating, and the medians are kept.
Memory: rank 0's peak resident set (ru_maxrss) in each tool, the process that also loads and saves. The batch differs
in kind (ilab_nb fills a token budget, TRL takes a fixed number of rows): the budget is set so that ilab_nb's rows per
step are about TRL's, and both are reported.

    .venv/bin/python bench/bench_vision.py           # ~4 minutes on 2 cores; writes bench/results_vision.md
"""
import argparse, datetime, json, os, statistics, sys, tempfile, textwrap, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")

from ilab_nb import FineTuneSession
from ilab_nb.sizes import count_params
from ilab_nb.vision_demo import vision_assets
from _trl import launch_trl      # bench/_trl.py: TRL on two processes, as the other benches run it

TRL_SCRIPT = textwrap.dedent('''
    import json, resource, sys, torch, datasets
    from pathlib import Path
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from trl import SFTConfig, SFTTrainer
    model_dir, data, out, bs, lr, seed, epochs = (sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]),
                                                  int(sys.argv[6]), int(sys.argv[7]))
    rows = [json.loads(l) for l in open(data)]
    for r in rows: r["images"] = [str(Path(data).parent / p) for p in r["images"]]      # paths relative to the file
    train = datasets.Dataset.from_list(rows).cast_column("images", datasets.Sequence(datasets.Image()))
    args = SFTConfig(output_dir=out, learning_rate=lr, per_device_train_batch_size=bs, num_train_epochs=epochs,
                     lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, logging_steps=1,
                     report_to=[], use_cpu=True, seed=seed, save_strategy="no", max_length=64,
                     assistant_only_loss=True, dataloader_num_workers=0)
    processor = AutoProcessor.from_pretrained(model_dir)
    tr = SFTTrainer(model=AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32), args=args,
                    train_dataset=train, processing_class=processor)
    loop = tr.train().metrics["train_runtime"]
    tr.save_model(out + "/final")
    if tr.accelerator.is_main_process:
        logs = [l for l in tr.state.log_history if "loss" in l]
        json.dump(dict(steps=tr.state.global_step, world=tr.accelerator.num_processes, losses=[l["loss"] for l in logs], loop=loop,
                       peak_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024), open(out + "/result.json", "w"))
''')


def run_ilab(va, root, budget, lr, seed, epochs):
    t0 = time.time()
    s = FineTuneSession(model=str(va.model_dir), data=str(va.train_file), num_processes=2, strategy="ddp", device="cpu",
                        num_train_epochs=epochs, logging_steps=1, learning_rate=lr, lr_scheduler_type="constant",
                        warmup_steps=0, max_tokens_per_batch=budget, max_seq_len=64, seed=seed, save_steps=None,
                        eval_steps=None, freeze_vision_tower=False, freeze_multi_modal_projector=False, runs_root=root)
    s.start()
    if s.wait() != "completed": raise SystemExit(f"ilab_nb run {s.run_id} ended {s.status}: {s.reason}\n{s.logs(30)}")
    wall = time.time() - t0
    train = s.metrics(kinds=("train",))
    return dict(wall=wall, steps=len(train), losses=[r["loss"] for r in train], loop=train[-1]["elapsed_s"],
                peak_mb=max(r.get("peak_mem_mb") or 0 for r in train))


def run_trl(va, root, bs, lr, seed, epochs):
    script = root / "trl_vision_sft.py"; script.write_text(TRL_SCRIPT)
    out = Path(tempfile.mkdtemp(dir=root, prefix="trl-"))
    wall, res = launch_trl(script, [va.model_dir, va.train_file, out, bs, lr, seed, epochs], out)
    return dict(wall=wall, steps=res["steps"], losses=res["losses"], peak_mb=res["peak_mb"], loop=res["loop"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trl-batch", type=int, default=8)
    ap.add_argument("--budget", type=int, default=224, help="ilab_nb's max_tokens_per_batch (per rank)")
    ap.add_argument("--rounds", type=int, default=2); ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results_vision.md"))
    a = ap.parse_args()
    import trl
    root = Path(tempfile.mkdtemp(prefix="bench-vision-"))
    os.environ.setdefault("ILAB_NB_LOCKS", str(root / "locks"))
    va = vision_assets(root / "vision")
    n = sum(1 for _ in open(va.train_file))
    got = {"ilab_nb": [], "TRL": []}
    for _ in range(a.rounds):
        got["ilab_nb"].append(run_ilab(va, root, a.budget, a.lr, 0, a.epochs))
        got["TRL"].append(run_trl(va, root, a.trl_batch, a.lr, 0, a.epochs))
    med = {k: statistics.median(r["wall"] for r in v) for k, v in got.items()}
    mem = {k: statistics.median(r["peak_mb"] for r in v) for k, v in got.items()}
    loop = {k: statistics.median(r["loop"] for r in v) for k, v in got.items()}
    import torch, transformers
    lines = [f"# Vision SFT: ilab_nb against TRL's SFTTrainer (`bench/bench_vision.py`)", "",
             f"{datetime.date.today()}, 2 CPU processes each (data parallel), the vision demo's tiny LLaVA "
             f"({count_params(va.model_dir)['total']:,} parameters, every one trained), its {n} colour questions "
             f"(one 32 x 32 image each), {a.epochs} epochs, loss on the answers, lr {a.lr:g} constant, AdamW; "
             f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}; "
             f"{a.rounds} rounds, alternating, medians.", "",
             "| | steps | questions per step (all ranks) | wall time (s), each round | median | questions/s | "
             "training loop (s), median | its questions/s | rank 0 peak RSS (MiB) | first -> last loss |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---|"]
    for k, v in got.items():
        r = v[0]
        walls = ", ".join(f"{x['wall']:.1f}" for x in v)
        lines.append(f"| {k} | {r['steps']} | {n * a.epochs / r['steps']:.1f} | {walls} | {med[k]:.1f} | "
                     f"{n * a.epochs / med[k]:.1f} | {loop[k]:.1f} | {n * a.epochs / loop[k]:.1f} | "
                     f"{mem[k]:,.0f} | {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f} |")
    lines += ["", f"ilab_nb / TRL: questions/s x{med['TRL'] / med['ilab_nb']:.2f} (the training loop alone: "
                  f"x{loop['TRL'] / loop['ilab_nb']:.2f}), rank 0 peak memory x{mem['ilab_nb'] / mem['TRL']:.2f}.",
              "Both walls include each tool's start-up (ilab_nb: preflight, the detached supervisor, `accelerate "
              "launch`; TRL: `accelerate launch`) and the final save; the training loop is ilab_nb's `elapsed_s` at its "
              "last step and TRL's `train_runtime`. Peak memory is each tool's rank 0 resident set "
              "(ru_maxrss: ilab_nb's `peak_mem_mb` of its train records, TRL's read at its end), the model's weights, "
              "gradients and AdamW moments, the images being decoded and each library's own."]
    text = "\n".join(lines) + "\n"
    print(text); Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
