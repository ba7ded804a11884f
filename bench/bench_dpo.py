"""DPO through ilab_nb against TRL's DPOTrainer, side by side in one run: the same model, pairs, epoch, beta, sigmoid
loss, learning rate and optimizer, 2 CPU processes each (data parallel: ilab_nb strategy="ddp"; TRL under
`accelerate launch`, as its docs run it), the reference's log-probabilities computed once before training in both
(TRL: precompute_ref_log_probs=True).

Timed: the whole command's wall time (model load, tokenization, the reference pass, the steps, the final save) and the
pairs trained per second of it; each pair of commands runs --rounds times, alternating, and the medians are kept.
The batch differs in kind (ilab_nb fills a token budget, TRL takes a fixed number of pairs): the budget is set so
that ilab_nb's mean pairs per step is about TRL's, and both are reported.

Learning (--learning): the demo model fine-tuned on its chat data (the demo's config, --sft-steps steps) is the
policy and reference; DPO on the shipped preference pairs of its atlas (chosen: the right fact, rejected: the same
attribute of another country), 2 CPU ranks, fsdp; held-out pairs' rewards/accuracies at each evaluation.

    .venv/bin/python bench/bench_dpo.py              # ~3 minutes on 2 cores; writes bench/results_dpo.md
    .venv/bin/python bench/bench_dpo.py --learning   # and the learning table (~5 more minutes)
"""
import argparse, datetime, json, os, statistics, sys, tempfile, textwrap, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")

from ilab_nb import FineTuneSession
from ilab_nb.demo import demo_assets
from ilab_nb.sizes import count_params
from _trl import launch_trl      # bench/_trl.py: TRL on two processes, as both benches run it

TRL_SCRIPT = textwrap.dedent('''
    import json, sys, torch, datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer
    model_dir, data, out, bs, lr, seed = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]), int(sys.argv[6])
    train = datasets.load_dataset("json", data_files=data, split="train", cache_dir=out + "/hf-cache")   # one cache for both ranks
    args = DPOConfig(output_dir=out, beta=0.1, loss_type=["sigmoid"], learning_rate=lr, per_device_train_batch_size=bs,
                     num_train_epochs=1, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
                     logging_steps=1, report_to=[], use_cpu=True, seed=seed, precompute_ref_log_probs=True,
                     save_strategy="no", disable_dropout=True, max_length=256, dataloader_num_workers=0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tr = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), args=args,
                    train_dataset=train, processing_class=tok)
    tr.train()
    tr.save_model(out + "/final")
    if tr.accelerator.is_main_process:
        logs = [l for l in tr.state.log_history if "loss" in l]
        json.dump(dict(steps=tr.state.global_step, world=tr.accelerator.num_processes, losses=[l["loss"] for l in logs]),
                  open(out + "/result.json", "w"))
''')


def run_ilab(demo, data, root, n, budget, lr, seed):
    t0 = time.time()
    s = FineTuneSession(model=str(demo.model_dir), data=str(data), method="dpo", beta=0.1, num_processes=2, strategy="ddp",
                        device="cpu", num_train_epochs=1, logging_steps=1, learning_rate=lr, lr_scheduler_type="constant",
                        warmup_steps=0, max_tokens_per_batch=budget, max_seq_len=256, batching="bucketed", seed=seed,
                        save_steps=None, runs_root=root)
    s.start()
    if s.wait() != "completed": raise SystemExit(f"ilab_nb run {s.run_id} ended {s.status}: {s.reason}\n{s.logs(30)}")
    wall = time.time() - t0
    train = s.metrics(kinds=("train",))
    return dict(wall=wall, steps=len(train), pairs=sum(r["pairs"] for r in train), losses=[r["loss"] for r in train],
                tokens=sum(r["tokens"] for r in train))


def run_trl(demo, data, root, n, bs, lr, seed):
    script = root / "trl_dpo.py"; script.write_text(TRL_SCRIPT)
    out = Path(tempfile.mkdtemp(dir=root, prefix="trl-"))
    wall, res = launch_trl(script, [demo.model_dir, data, out, bs, lr, seed], out)
    return dict(wall=wall, steps=res["steps"], pairs=n, losses=res["losses"])


def learning(a, demo, root):
    from ilab_nb.rundir import RunPaths
    sft = FineTuneSession(**demo.train_config(max_steps=a.sft_steps, save_steps=None, eval_steps=None, eval_data=None), runs_root=root)
    sft.start()
    if sft.wait() != "completed": raise SystemExit(f"SFT run {sft.run_id} ended {sft.status}: {sft.reason}")
    s = FineTuneSession(model=str(RunPaths(sft.run_dir).final), data=str(demo.pref_train_file), eval_data=str(demo.pref_eval_file),
                        method="dpo", beta=a.dpo_beta, num_processes=2, strategy="fsdp", device="cpu", max_steps=a.dpo_steps,
                        logging_steps=10, learning_rate=a.dpo_lr, lr_scheduler_type="cosine", warmup_steps=10,
                        eval_steps=a.dpo_steps // 6, max_tokens_per_batch=2048, max_seq_len=256, seed=0, save_steps=None,
                        runs_root=root)
    s.start()
    if s.wait() != "completed": raise SystemExit(f"DPO run {s.run_id} ended {s.status}: {s.reason}")
    n = sum(1 for _ in open(demo.pref_eval_file)); m = sum(1 for _ in open(demo.pref_train_file))
    lines = ["", f"## Learning: held-out preference pairs of the demo's atlas, 2 CPU ranks, fsdp", "",
             f"The policy and reference: the demo model after {a.sft_steps} steps of the demo's chat fine-tune. DPO on the "
             f"{m} shipped pairs, beta {a.dpo_beta:g}, sigmoid, lr {a.dpo_lr:g} cosine, {a.dpo_steps} steps; {n} held-out pairs (prompts never "
             "seen in training). An untrained policy equals the reference, so every margin is 0 (ties: accuracy 0).", "",
             "| step | held-out loss | held-out rewards/accuracies | held-out rewards/margins |", "|---:|---:|---:|---:|"]
    lines += [f"| {r['step']} | {r['eval_loss']:.4f} | {r['eval_rewards/accuracies']:.2f} | {r['eval_rewards/margins']:.3f} |"
              for r in s.metrics(kinds=("eval",))]
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=256); ap.add_argument("--trl-batch", type=int, default=8)
    ap.add_argument("--budget", type=int, default=1152, help="ilab_nb's max_tokens_per_batch (per rank)")
    ap.add_argument("--rounds", type=int, default=2); ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--learning", action="store_true"); ap.add_argument("--sft-steps", type=int, default=160)
    ap.add_argument("--dpo-steps", type=int, default=120); ap.add_argument("--dpo-lr", type=float, default=1e-3)
    ap.add_argument("--dpo-beta", type=float, default=0.25)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results_dpo.md"))
    a = ap.parse_args()
    import trl
    root = Path(tempfile.mkdtemp(prefix="bench-dpo-"))
    os.environ.setdefault("ILAB_NB_LOCKS", str(root / "locks"))
    demo = demo_assets(root / "demo")
    data = root / "pairs.jsonl"
    data.write_text("\n".join(Path(demo.pref_train_file).read_text().splitlines()[:a.pairs]) + "\n")
    got = {"ilab_nb": [], "TRL": []}
    for _ in range(a.rounds):
        got["ilab_nb"].append(run_ilab(demo, data, root, a.pairs, a.budget, a.lr, 0))
        got["TRL"].append(run_trl(demo, data, root, a.pairs, a.trl_batch, a.lr, 0))
    med = {k: statistics.median(r["wall"] for r in v) for k, v in got.items()}
    import torch, transformers
    lines = [f"# DPO: ilab_nb against TRL's DPOTrainer (`bench/bench_dpo.py`)", "",
             f"{datetime.date.today()}, 2 CPU processes each, the demo model ({count_params(demo.model_dir)['total']:,} parameters), "
             f"{a.pairs} of the demo's preference pairs, one epoch, sigmoid loss, beta 0.1, lr {a.lr:g}, AdamW; "
             f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}; "
             f"{a.rounds} rounds, alternating, medians.", "",
             "| | steps | pairs per step (all ranks) | wall time (s), each round | median | pairs/s | answer tokens/s | first -> last loss |",
             "|---|---:|---:|---|---:|---:|---:|---|"]
    tokens = got["ilab_nb"][0]["tokens"]          # the loss-bearing (answer) tokens of the pairs, both sides: the same data for both
    for k, v in got.items():
        r = v[0]
        walls = ", ".join(f"{x['wall']:.1f}" for x in v)
        lines.append(f"| {k} | {r['steps']} | {r['pairs'] / r['steps']:.1f} | {walls} | "
                     f"{med[k]:.1f} | {a.pairs / med[k]:.1f} | {tokens / med[k]:,.0f} | {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f} |")
    lines += ["", f"ilab_nb / TRL: wall time x{med['ilab_nb'] / med['TRL']:.2f}, pairs/s x{med['TRL'] / med['ilab_nb']:.2f}.",
              "Both walls include each tool's start-up (ilab_nb: preflight, the detached supervisor, `accelerate launch`; "
              "TRL: `accelerate launch`) and the final save; answer tokens are ilab_nb's count of the pairs' answer tokens "
              f"({tokens:,.0f}), the same data for both. The losses are of each tool's own batches: both hover near ln 2 "
              "in one epoch of a model with random weights."]
    if a.learning: lines += learning(a, demo, root)
    text = "\n".join(lines) + "\n"
    print(text); Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
