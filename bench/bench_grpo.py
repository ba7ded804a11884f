"""GRPO through ilab_nb against TRL's GRPOTrainer, side by side: the same demo model, prompts (capital questions of the
demo's atlas), reward function (a file both load), generation settings (num_generations, max_completion_length,
temperature 1, top_p 1, no top-k), loss (dapo, beta 0), learning rate and optimizer, 2 CPU processes each (ilab_nb
strategy="fsdp", or --strategy ddp, through FineTuneSession; TRL under `accelerate launch`, as its docs run it), 8 completions per process
per optimizer step (2 prompts x 4), --steps steps.

Timed: the whole command's wall time (start-up, model load, the steps with their sampling, the final save), and
completions/s and optimizer steps/s of it; --rounds rounds, alternating, medians.

    .venv/bin/python bench/bench_grpo.py            # a few minutes on 2 cores; writes bench/results_grpo.md

`--tools`: GRPO with tools instead, the agent demo (`ilab_nb.agent_demo.agent_assets()`: a tiny Llama with TRL's
Qwen2.5 chat template, warm-started to call tools, and its vault prompts), its environment `AgentVault` (TRL's
environment_factory: reset(**row) per rollout, its methods the tools, get_reward the only reward), 8 completions per
prompt, 8 per process per step, max_completion_length 32, max_tool_calling_iterations 3, lr 1e-3; episodes/s, the
reward and tools/call_frequency per step of each. Appends a section to bench/results_grpo.md.

    .venv/bin/python bench/bench_grpo.py --tools --rounds 3
"""
import argparse, datetime, json, os, statistics, subprocess, sys, tempfile, textwrap, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")

from ilab_nb import FineTuneSession
from ilab_nb.demo import demo_assets, read_chat_jsonl, shipped_data_dir
from ilab_nb.sizes import count_params
from _trl import launch_trl      # bench/_trl.py: TRL on two processes, as both benches run it

REWARD = textwrap.dedent('''
    def right_capital(prompts, completions, answer, **kw):
        return [float(c[0]["content"].strip().lower() == a.lower()) for c, a in zip(completions, answer)]
''')

TRL_SCRIPT = textwrap.dedent('''
    import importlib.util, json, sys, torch, datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    model_dir, data, out, reward_file, steps, gens, per, comp, lr, seed = sys.argv[1:11]
    spec = importlib.util.spec_from_file_location("reward", reward_file); mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    train = datasets.load_dataset("json", data_files=data, split="train", cache_dir=out + "/hf-cache")
    args = GRPOConfig(output_dir=out, num_generations=int(gens), per_device_train_batch_size=int(per),
                      max_completion_length=int(comp), temperature=1.0, top_p=1.0, top_k=0, beta=0.0, loss_type="dapo",
                      learning_rate=float(lr), max_steps=int(steps), lr_scheduler_type="constant", warmup_steps=0,
                      weight_decay=0.0, max_grad_norm=1.0, logging_steps=1, report_to=[], use_cpu=True, bf16=False,
                      gradient_checkpointing=False, seed=int(seed), save_strategy="no", dataloader_num_workers=0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tr = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), reward_funcs=[mod.right_capital],
                     args=args, train_dataset=train, processing_class=tok)
    tr.train()
    tr.save_model(out + "/final")
    if tr.accelerator.is_main_process:
        logs = [l for l in tr.state.log_history if "reward" in l]
        json.dump(dict(steps=tr.state.global_step, world=tr.accelerator.num_processes, rewards=[l["reward"] for l in logs],
                       lengths=[l["completions/mean_length"] for l in logs]), open(out + "/result.json", "w"))
''')


TRL_TOOLS_SCRIPT = textwrap.dedent('''
    import json, os, sys, torch, datasets
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    from ilab_nb.agent_demo import AgentVault
    model_dir, data, out, steps, gens, per, comp, iters, lr, seed = sys.argv[1:11]
    train = datasets.load_dataset("json", data_files=data, split="train", cache_dir=out + "/hf-cache")
    args = GRPOConfig(output_dir=out, num_generations=int(gens), per_device_train_batch_size=int(per),
                      max_completion_length=int(comp), max_tool_calling_iterations=int(iters), temperature=1.0,
                      top_p=1.0, top_k=0, beta=0.0, loss_type="dapo", learning_rate=float(lr), max_steps=int(steps),
                      lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
                      logging_steps=1, report_to=[], use_cpu=True, bf16=False, gradient_checkpointing=False,
                      seed=int(seed), save_strategy="no", dataloader_num_workers=0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tr = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), reward_funcs=[],
                     environment_factory=AgentVault, args=args, train_dataset=train, processing_class=tok)
    tr.train()
    tr.save_model(out + "/final")
    if tr.accelerator.is_main_process:
        logs = [l for l in tr.state.log_history if "reward" in l]
        end = [l for l in tr.state.log_history if "train_runtime" in l]
        json.dump(dict(steps=tr.state.global_step, world=tr.accelerator.num_processes, rewards=[l["reward"] for l in logs],
                       lengths=[l["completions/mean_length"] for l in logs],
                       calls=[l["tools/call_frequency"] for l in logs],
                       loop=end[-1]["train_runtime"] if end else None), open(out + "/result.json", "w"))
''')


def load():
    "The 1, 5 and 15 minute load averages."
    return tuple(round(x, 2) for x in os.getloadavg())


def capital_rows(n):
    rows = [{"prompt": c[:i], "answer": m["content"]} for c in read_chat_jsonl(shipped_data_dir() / "train.jsonl")
            for i, m in enumerate(c) if m["role"] == "assistant" and "capital" in c[i - 1]["content"].lower()]
    return rows[:n]


def run_ilab(a, model, data, reward, root):
    t0 = time.time()
    task = (dict(environment_factory="ilab_nb.agent_demo:AgentVault", max_tool_calling_iterations=a.iters,
                 tool_timeout=10) if a.tools else dict(reward_funcs=[f"{reward}:right_capital"]))
    s = FineTuneSession(model=str(model), data=str(data), method="grpo", **task,
                        num_generations=a.gens, per_device_train_batch_size=a.per, max_completion_length=a.comp,
                        num_processes=2, strategy=a.strategy, device="cpu", max_steps=a.steps, logging_steps=1,
                        learning_rate=a.lr, lr_scheduler_type="constant", max_seq_len=512, seed=0, save_steps=None,
                        num_completions_to_print=0, runs_root=root)
    s.start()
    try: status = s.wait(timeout=a.timeout)
    except TimeoutError:
        s.stop(timeout=60)
        raise SystemExit(f"ilab_nb run {s.run_id} ran past {a.timeout:g} s: stopped\n{s.logs(30)}")
    if status != "completed": raise SystemExit(f"ilab_nb run {s.run_id} ended {s.status}: {s.reason}\n{s.logs(30)}")
    wall = time.time() - t0
    train = s.metrics(kinds=("train",))
    return dict(wall=wall, steps=len(train), rewards=[r["reward"] for r in train],
                lengths=[r["completions/mean_length"] for r in train],
                calls=[r.get("tools/call_frequency") for r in train], loop=train[-1].get("elapsed_s"))


def run_trl(a, model, data, reward, root):
    script = root / "trl_grpo.py"; script.write_text(TRL_SCRIPT)
    out = Path(tempfile.mkdtemp(dir=root, prefix="trl-"))
    if a.tools:
        script = root / "trl_grpo_tools.py"; script.write_text(TRL_TOOLS_SCRIPT)
        wall, res = launch_trl(script, [model, data, out, a.steps, a.gens, a.per, a.comp, a.iters, a.lr, 0], out,
                               timeout=a.timeout)
        return dict(wall=wall, **{k: res[k] for k in ("steps", "rewards", "lengths", "calls", "loop")})
    wall, res = launch_trl(script, [model, data, out, reward, a.steps, a.gens, a.per, a.comp, a.lr, 0], out)
    return dict(wall=wall, steps=res["steps"], rewards=res["rewards"], lengths=res["lengths"])


def tools_section(a, got, model, loads, root) -> str:
    "The `--tools` section of results_grpo.md: the table of rounds, the per-step curves of the first round, the ratio."
    import torch, transformers, trl
    med = {k: statistics.median(r["wall"] for r in v) for k, v in got.items()}
    n = a.steps * 2 * a.per                                     # episodes sampled (and trained on), all ranks
    def f(x): return "-" if x is None else f"{x:.2f}"
    def curve(v, key):
        "First -> last step of each round (once where the rounds sampled the same)."
        ends = [f"{x[key][0]:.3f} -> {x[key][-1]:.3f}" for x in v]
        return ends[0] + (" (each round)" if len(v) > 1 else "") if all(x[key] == v[0][key] for x in v) else ", ".join(ends)
    lines = [f"## GRPO with tools: ilab_nb against TRL's GRPOTrainer tool loop (`bench/bench_grpo.py --tools`)", "",
             f"{datetime.date.today()}, 2 CPU processes each (ilab_nb strategy={a.strategy}; TRL DDP under `accelerate "
             f"launch`, `GRPOConfig(use_cpu=True)`), the agent demo model ({count_params(model)['total']:,} parameters, "
             f"`agent_assets()`), its vault prompts, environment `AgentVault` (its `get_reward` the only reward: TRL "
             f"accepts `reward_funcs=[]` with it), {a.steps} optimizer steps, {a.gens} completions per prompt, {a.per} "
             f"episodes per process per step ({n} in all), max_completion_length {a.comp}, max_tool_calling_iterations "
             f"{a.iters}, temperature 1, loss dapo, beta 0, lr {a.lr:g}, AdamW, seed 0; torch {torch.__version__}, "
             f"transformers {transformers.__version__}, trl {trl.__version__}; {a.rounds} round(s), alternating "
             f"(ilab_nb first), medians; load averages (1, 5, 15 min) before each round: "
             f"{'; '.join(', '.join(map(str, l)) for l in loads)}.", "",
             f"    {a.cmd}", "",
             "| | steps | wall time (s), each round | median | episodes/s | optimizer steps/s | training loop (s), each round "
             "| mean completion length | reward, first -> last step | tools/call_frequency, first -> last step |",
             "|---|---:|---|---:|---:|---:|---|---:|---|---|"]
    for k, v in got.items():
        r, walls = v[0], ", ".join(f"{x['wall']:.1f}" for x in v)
        lines.append(f"| {k} | {r['steps']} | {walls} | {med[k]:.1f} | "
                     f"{n / med[k]:.1f} | {r['steps'] / med[k]:.3f} | {', '.join(f(x['loop']) for x in v)} | "
                     f"{statistics.mean(r['lengths']):.1f} | "
                     + " | ".join(curve(v, key) for key in ("rewards", "calls"))
                     + " |")
    loops = statistics.median(x['loop'] for x in got['TRL']) / statistics.median(x['loop'] for x in got['ilab_nb'])
    lines += ["", f"ilab_nb / TRL: episodes/s x{med['TRL'] / med['ilab_nb']:.2f} (the same steps and episodes in both: "
              f"the ratio of median wall times); the training loops alone (medians) x{loops:.2f}. Reward and call frequency: each round's first -> last step. Walls "
              "include each tool's start-up and the final save; the training loop is ilab_nb's last train record's "
              "`elapsed_s` and TRL's `train_runtime`.", "",
              "Per step, round 1 (reward / tools/call_frequency):", "",
              "| step | " + " | ".join(f"{k} reward | {k} calls" for k in got) + " |",
              "|---:|" + "---:|---:|" * len(got)]
    for i in range(max(len(v[0]["rewards"]) for v in got.values())):
        cells = []
        for v in got.values():
            r = v[0]
            cells += [f"{r['rewards'][i]:.3f}" if i < len(r["rewards"]) else "-",
                      f"{r['calls'][i]:.3f}" if i < len(r["calls"]) else "-"]
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10); ap.add_argument("--gens", type=int, default=None)
    ap.add_argument("--per", type=int, default=8); ap.add_argument("--comp", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None); ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--tools", action="store_true", help="GRPO with tools: the agent demo and its AgentVault")
    ap.add_argument("--iters", type=int, default=3, help="--tools: max_tool_calling_iterations")
    ap.add_argument("--timeout", type=float, default=900, help="--tools: seconds a run may take before it is killed")
    ap.add_argument("--strategy", default="fsdp", choices=["fsdp", "ddp"], help="ilab_nb's (TRL runs DDP)")
    ap.add_argument("--model", default=None, help="the model (default: the demo model with random weights)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results_grpo.md"))
    a = ap.parse_args()
    a.cmd = " ".join([".venv/bin/python bench/bench_grpo.py", *sys.argv[1:]])
    for k, plain, tools in (("gens", 4, 8), ("comp", 8, 32), ("lr", 1e-4, 1e-3)):
        if getattr(a, k) is None: setattr(a, k, tools if a.tools else plain)
    import torch, transformers, trl
    root = Path(tempfile.mkdtemp(prefix="bench-grpo-"))
    os.environ.setdefault("ILAB_NB_LOCKS", str(root / "locks"))
    if a.tools: return main_tools(a, root)
    demo = demo_assets(root / "demo")
    model = Path(a.model) if a.model else demo.model_dir
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in capital_rows(a.steps * 2 * a.per // a.gens)))
    reward = root / "reward.py"; reward.write_text(REWARD)
    got = {"ilab_nb": [], "TRL": []}
    for _ in range(a.rounds):
        got["ilab_nb"].append(run_ilab(a, model, data, reward, root))
        got["TRL"].append(run_trl(a, model, data, reward, root))
    med = {k: statistics.median(r["wall"] for r in v) for k, v in got.items()}
    n = a.steps * 2 * a.per                                     # completions sampled (and trained on), all ranks
    lines = ["# GRPO: ilab_nb against TRL's GRPOTrainer (`bench/bench_grpo.py`)", "",
             f"{datetime.date.today()}, 2 CPU processes each (ilab_nb strategy={a.strategy}), {'the demo model' if not a.model else model.name} "
             f"({count_params(model)['total']:,} parameters), capital questions of the demo's atlas, {a.steps} optimizer steps, "
             f"{a.gens} completions per prompt, {a.per} completions per process per step ({n} in all), max_completion_length "
             f"{a.comp}, temperature 1, loss dapo, beta 0, lr {a.lr:g}, AdamW; torch {torch.__version__}, transformers "
             f"{transformers.__version__}, trl {trl.__version__}; {a.rounds} round(s), alternating, medians.", "",
             "| | steps | wall time (s), each round | median | completions/s | optimizer steps/s | mean completion length | reward, first -> last step |",
             "|---|---:|---|---:|---:|---:|---:|---|"]
    for k, v in got.items():
        r = v[0]
        walls = ", ".join(f"{x['wall']:.1f}" for x in v)
        lines.append(f"| {k} | {r['steps']} | {walls} | {med[k]:.1f} | {n / med[k]:.1f} | "
                     f"{r['steps'] / med[k]:.3f} | {statistics.mean(r['lengths']):.1f} | {r['rewards'][0]:.3f} -> {r['rewards'][-1]:.3f} |")
    lines += ["", f"ilab_nb / TRL: completions/s x{med['TRL'] / med['ilab_nb']:.2f}, optimizer steps/s x{med['TRL'] / med['ilab_nb']:.2f} "
              "(the same steps and completions in both: the ratio of wall times).",
              "Both walls include each tool's start-up (ilab_nb: preflight, the detached supervisor, `accelerate launch`; TRL: "
              "`accelerate launch`) and the final save. Each samples its own completions (different random streams), so "
              "their lengths and rewards differ a little."]
    text = "\n".join(lines) + "\n"
    print(text); Path(a.out).write_text(text)


def main_tools(a, root):
    from ilab_nb.agent_demo import agent_assets
    agent = agent_assets()                         # built once per machine (~/.cache/ilab_nb/agent)
    rows = agent.train_file.read_text().splitlines()
    need = a.steps * 2 * a.per // a.gens           # prompts the steps take, all ranks: the vaults over again
    data = root / "agent-prompts.jsonl"
    data.write_text("".join(rows[i % len(rows)] + "\n" for i in range(max(need, len(rows)))))
    got, loads = {"ilab_nb": [], "TRL": []}, []
    for i in range(a.rounds):
        loads.append(load())
        got["ilab_nb"].append(run_ilab(a, agent.model_dir, data, None, root))
        print(f"round {i + 1} ilab_nb: {got['ilab_nb'][-1]}", flush=True)
        got["TRL"].append(run_trl(a, agent.model_dir, data, None, root))
        print(f"round {i + 1} TRL: {got['TRL'][-1]}", flush=True)
    loads.append(load())
    text = tools_section(a, got, agent.model_dir, loads, root)
    print(text)
    out = Path(a.out)
    out.write_text(out.read_text().rstrip("\n") + "\n\n" + text if out.exists() else text)


if __name__ == "__main__":
    main()
