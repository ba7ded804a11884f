"""A pruning search against the grid and against the same search unpruned, side by side in one run, on the demo task:
the demo model and its chat data, held-out loss on the demo's own eval file (`eval_data`), one CPU process a run, two
runs at a time (2 cores), 120 steps each (the demo's recipe otherwise: cosine schedule, 2,048 tokens a micro-batch,
seed 0), evaluated every 20 steps.

- grid: `Sweep` over learning_rate 1e-4, 3e-4, 1e-3, 3e-3 x warmup_steps 0, 20, 40 (12 runs, every one to the end);
- pruned: `FineTuneSession.search` over learning_rate ('log', 1e-4, 1e-2) x warmup_steps ('int', 0, 40), 12 trials,
  TPE seeded 0, Optuna's MedianPruner with its defaults (5 startup trials), 2 trials at a time;
- unpruned: the same search with pruner=None;
- transformers: `Trainer.hyperparameter_search(backend="optuna")` over the same space, 12 trials, the same seeded TPE
  sampler and MedianPruner, in one process (it runs trials one after another; torch's 2 threads), on the same rows
  tokenized with the same chat template and assistant-only labels, 16 rows a batch, 120 steps, evaluated every 20.

Each: the best held-out eval_loss at a run's end, the trials pruned, the rank-seconds of all its runs (each attempt's
time from start to end times its processes; transformers': its one process's wall time) and the wall time.

    .venv/bin/python bench/bench_search.py      # ~10 minutes on 2 cores; writes bench/results_search.md
"""
import datetime, json, math, os, platform, subprocess, sys, tempfile, textwrap, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")

from ilab_nb import FineTuneSession, Sweep
from ilab_nb.demo import demo_assets
from ilab_nb.monitor import RunMonitor
from ilab_nb.runstore import RunStore
from ilab_nb.search import metric_values, rank_seconds

FIELDS = dict(num_processes=1, strategy="single", device="cpu", precision="fp32", max_steps=120,
              lr_scheduler_type="cosine", weight_decay=0.0, max_grad_norm=1.0, max_tokens_per_batch=2048,
              max_seq_len=256, batching="bucketed", logging_steps=10, eval_steps=20, save_steps=1000, seed=0)
GRID = dict(learning_rate=[1e-4, 3e-4, 1e-3, 3e-3], warmup_steps=[0, 20, 40])
SPACE = {"learning_rate": ("log", 1e-4, 1e-2), "warmup_steps": ("int", 0, 40)}


def final_eval(store, run_id):
    "The eval_loss at the run's last evaluation (its end), or nan."
    v = metric_values(RunMonitor(store.run_dir(run_id)), "eval_loss")
    return v[-1][1] if v else math.nan


def grid(a, root):
    t0 = time.time()
    sw = Sweep.create(a.model_dir, a.train_file, eval_data=a.eval_file, runs_root=root, name="grid", **GRID, **FIELDS)
    sw.wait(timeout=3600)
    store = RunStore(root)
    finals = [final_eval(store, r) for r in sw.run_ids]
    best = min(range(len(finals)), key=lambda i: finals[i])
    return dict(what="grid (Sweep, 12 points)", trials=len(finals), pruned=0, best=finals[best],
                best_at=sw.spec["runs"][best]["values"],
                rank_s=sum(rank_seconds(store.read_state(r)) for r in sw.run_ids),
                wall=time.time() - t0)


def search(a, root, pruner):
    t0 = time.time()
    s = FineTuneSession.search(a.model_dir, a.train_file, eval_data=a.eval_file, space=SPACE, n_trials=12,
                               pruner=pruner, parallel=2, runs_root=root, name="pruned" if pruner else "unpruned",
                               **FIELDS)
    assert s.wait(timeout=3600) == "completed", s
    ts, b = s.trials(), s.best_trial
    return dict(what=f"search, pruner={pruner!r} (12 trials)", trials=len(ts),
                pruned=sum(t["state"] == "pruned" for t in ts), best=b["value"], best_at=b["values"],
                rank_s=sum(s.results().rank_seconds), wall=time.time() - t0,
                states=[t["state"] for t in ts])


HF_SCRIPT = textwrap.dedent('''
    import json, sys, time, optuna, torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq, Trainer, TrainingArguments
    model_dir, train_file, eval_file, out = sys.argv[1:5]
    tok = AutoTokenizer.from_pretrained(model_dir)
    def rows(path):
        out = []
        for line in open(path):
            enc = tok.apply_chat_template(json.loads(line)["messages"], tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True, truncation=True, max_length=256)
            ids, mask = enc["input_ids"], enc["assistant_masks"]
            out.append(dict(input_ids=ids, labels=[i if m else -100 for i, m in zip(ids, mask)]))
        return out
    train, held = rows(train_file), rows(eval_file)
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=16, per_device_eval_batch_size=32,
                             max_steps=120, lr_scheduler_type="cosine", weight_decay=0.0, max_grad_norm=1.0,
                             eval_strategy="steps", eval_steps=20, logging_steps=10, save_strategy="no", report_to=[],
                             use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True)
    tr = Trainer(model_init=lambda trial=None: AutoModelForCausalLM.from_pretrained(model_dir), args=args,
                 train_dataset=train, eval_dataset=held, data_collator=DataCollatorForSeq2Seq(tok, padding=True))
    space = lambda t: {"learning_rate": t.suggest_float("learning_rate", 1e-4, 1e-2, log=True),
                       "warmup_steps": t.suggest_int("warmup_steps", 0, 40)}
    t0 = time.time()
    best = tr.hyperparameter_search(hp_space=space, n_trials=12, direction="minimize", backend="optuna",
                                    compute_objective=lambda m: m["eval_loss"],
                                    sampler=optuna.samplers.TPESampler(seed=0), pruner=optuna.pruners.MedianPruner(),
                                    storage=f"sqlite:///{out}/hf.db", study_name="hf")
    wall = time.time() - t0
    states = [t.state.name for t in optuna.load_study(study_name="hf", storage=f"sqlite:///{out}/hf.db").trials]
    json.dump(dict(best=best.objective, params=best.hyperparameters, wall=wall, pruned=states.count("PRUNED")),
              open(out + "/result.json", "w"))
''')


def hf_search(a, root):
    "transformers' Trainer.hyperparameter_search on the same task, in its own process."
    out = Path(tempfile.mkdtemp())
    script = out / "hf_search.py"; script.write_text(HF_SCRIPT)
    t0 = time.time()
    p = subprocess.run([sys.executable, str(script), str(a.model_dir), str(a.train_file), str(a.eval_file), str(out)],
                       capture_output=True, text=True, timeout=7200)
    if p.returncode: raise SystemExit(f"Trainer.hyperparameter_search failed:\n{p.stderr[-4000:]}")
    res, wall = json.loads((out / "result.json").read_text()), time.time() - t0
    return dict(what="transformers Trainer.hyperparameter_search, optuna, MedianPruner (12 trials)", trials=12,
                pruned=res["pruned"], best=res["best"], best_at=res["params"], rank_s=wall, wall=wall)


def main():
    a = demo_assets()
    root = Path(tempfile.mkdtemp()) / "runs"
    rows = [grid(a, root), search(a, root, "median"), search(a, root, None), hf_search(a, root)]
    g, p, u, h = rows
    fmt = lambda v: ", ".join(f"{k}={x:.3g}" if isinstance(x, float) else f"{k}={x}" for k, x in v.items())
    lines = [
        "# A pruning search against the grid and the unpruned search (bench/bench_search.py)", "",
        f"{datetime.date.today()}, {platform.node()}, {os.cpu_count()} CPUs; the demo model and data, 120 steps a run, "
        "1 CPU process a run, 2 runs at a time, held-out eval_loss on the demo's eval file at each run's end.", "",
        "| what | trials | pruned | best held-out eval_loss | at | rank-seconds | wall s |",
        "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['what']} | {r['trials']} | {r['pruned']} | {r['best']:.4f} | {fmt(r['best_at'])} | "
                     f"{r['rank_s']:.0f} | {r['wall']:.0f} |")
    lines += ["", f"- Pruned search's best over the grid's best: {p['best'] / g['best']:.3f} "
              f"(goal: within 10 %, i.e. <= 1.10).",
              f"- Trials pruned: {p['pruned']} of {p['trials']} (goal: at least a third). Trial states in order: "
              f"{', '.join(p['states'])}.",
              f"- Rank-seconds, pruned over unpruned search: {p['rank_s'] / u['rank_s']:.3f}; over the grid: "
              f"{p['rank_s'] / g['rank_s']:.3f}.",
              f"- Unpruned search's best over the grid's best: {u['best'] / g['best']:.3f}.",
              f"- transformers' search: wall {h['wall']:.0f} s against the pruned search's {p['wall']:.0f} s "
              f"({h['wall'] / p['wall']:.2f}x); its best held-out eval_loss {h['best']:.4f} is on its own batches "
              f"(16 rows, not a token budget), so beside ilab_nb's only roughly."]
    out = ROOT / "bench" / "results_search.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
