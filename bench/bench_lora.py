"""LoRA against a full fine-tune, side by side in one run, through FineTuneSession (the product's own path):

- cost: the same model, data, steps and ranks (2 CPU processes, fsdp, fp32; with --cuda: every local GPU, bf16);
  tokens/s (median of the train records after the first), the ranks' peak memory (CPU: the process's peak RSS,
  which keeps what the allocator freed; CUDA: max allocated), the training state each rank holds (16 bytes per
  trainable parameter: fp32 weight, gradient, AdamW's moments; the frozen base in its dtype; from the header's counts) and
  the size of one checkpoint and of final/;
- learning (--learning): held-out accuracy on the demo's atlas. The demo model is built from a config with random
  weights, and LoRA adapts a base that already knows something: so both methods continue the same partly trained
  base (a full fine-tune of the demo for --base-steps steps) for the same further steps; the full fine-tune of the
  whole budget from scratch is given beside them.

    .venv/bin/python bench/bench_lora.py              # cost, ~3 minutes on 2 cores; writes bench/results_lora.md
    .venv/bin/python bench/bench_lora.py --learning   # also the learning comparison (~10 more minutes)
    python bench/bench_lora.py --cuda                 # on a GPU machine (the GPU check runs this)
"""
import argparse, datetime, json, os, statistics, sys, tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")

from ilab_nb import FineTuneSession
from ilab_nb.demo import demo_assets
from ilab_nb.rundir import RunPaths


def build_model(out: Path, tokenizer_dir: Path, hidden=768, layers=8):
    "A Llama of ~60M parameters on the demo's tokenizer (random weights), big enough for LoRA's savings to show."
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    if (out / "config.json").exists(): return out
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                                     num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=512, tie_word_embeddings=True,
                                     pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id))
    m.save_pretrained(out); tok.save_pretrained(out)
    return out


def du(p: Path) -> int: return sum(f.stat().st_size for f in Path(p).rglob("*") if f.is_file())


def run(model, data, root, **fields):
    s = FineTuneSession(model=str(model), data=str(data), runs_root=root, **fields)
    s.start()
    if s.wait() != "completed": raise SystemExit(f"run {s.run_id} ended {s.status}: {s.reason}\n{s.logs(30)}")
    return s


def cost(a, demo, root):
    model = build_model(root / "model-60m", demo.model_dir)
    cuda = a.cuda
    base = dict(num_processes=a.processes, strategy="fsdp", device="cuda" if cuda else "cpu", precision="bf16" if cuda else "fp32",
                max_steps=a.steps, logging_steps=1, save_steps=a.steps, learning_rate=1e-3, max_tokens_per_batch=2048,
                max_seq_len=256, batching="bucketed" if not cuda else "auto", seed=0)
    rows = []
    for name, extra in (("full fine-tune", {}), ("LoRA r=16 (all linear layers)", dict(lora=dict(r=16, lora_alpha=32)))):
        s = run(model, demo.train_file, root, **base, **extra)
        train = s.metrics(kinds=("train",)); head = s.metrics(kinds=("header",))[0]
        ck = RunPaths(s.run_dir).checkpoint(a.steps)
        w = head["world_size"] if head["strategy"] == "fsdp" else 1
        train_local = head["trainable_params"] / w
        frozen_local = max(head["params_per_rank"]) - train_local
        state = (2 if head["precision"] == "bf16" else 4) * frozen_local + 16 * train_local   # frozen base; fp32 weights, grads, moments
        rows.append(dict(name=name, tokens_per_s=statistics.median(r["tokens_per_s"] for r in train[1:]),
                         peak_mb=max(r["peak_mem_mb"] for r in train), state_mb=state / 2**20, trainable=head.get("trainable_params"),
                         total=head["params_total"], ckpt=du(ck), final=du(RunPaths(s.run_dir).final)))
    return rows


def accuracy(session, demo, limit=40):
    from ilab_nb.demo import evaluate_answers
    m, tok = session.load_model()
    return evaluate_answers(m, tok, demo.eval_file, limit=limit)["accuracy"]


def learning(a, demo, root):
    cfg = lambda steps, **kw: dict(demo.train_config(max_steps=steps, save_steps=None, eval_steps=None, eval_data=None), **kw)
    def go(model, **kw):
        f = cfg(**kw); f.pop("model"); data = f.pop("data")
        s = FineTuneSession(model=str(model), data=data, runs_root=root, **f); s.start()
        if s.wait() != "completed": raise SystemExit(f"run {s.run_id} ended {s.status}: {s.reason}")
        return s
    total = a.base_steps + a.more_steps
    scratch = go(demo.model_dir, steps=total)
    base = go(demo.model_dir, steps=a.base_steps)
    out = [("full fine-tune from scratch", total, "-", accuracy(scratch, demo)),
           (f"the partly trained base ({a.base_steps} steps)", a.base_steps, "-", accuracy(base, demo))]
    more = go(RunPaths(base.run_dir).final, steps=a.more_steps)
    out.append((f"base + full fine-tune", a.more_steps, f"{more.config.learning_rate:g}", accuracy(more, demo)))
    for r, lr in ((16, 1e-2), (32, 1e-2)):
        s = go(RunPaths(base.run_dir).final, steps=a.more_steps, lora=dict(r=r, lora_alpha=2 * r), learning_rate=lr)
        head = s.metrics(kinds=("header",))[0]
        out.append((f"base + LoRA r={r} ({100 * head['trainable_params'] / head['params_total']:.1f} % trains)", a.more_steps,
                    f"{lr:g}", accuracy(s, demo)))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cuda", action="store_true"); ap.add_argument("--processes", type=int, default=None)
    ap.add_argument("--steps", type=int, default=12); ap.add_argument("--learning", action="store_true")
    ap.add_argument("--learning-only", action="store_true", help="skip the cost table (e.g. to rerun the learning runs alone)")
    ap.add_argument("--base-steps", type=int, default=60); ap.add_argument("--more-steps", type=int, default=180)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results_lora.md"))
    a = ap.parse_args()
    if a.processes is None:
        import torch
        a.processes = torch.cuda.device_count() if a.cuda else 2
    root = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    os.environ.setdefault("ILAB_NB_LOCKS", str(root / "locks"))
    demo = demo_assets(root / "demo")
    if a.learning_only:
        lines = ["## Learning: held-out accuracy on 40 demo conversations, 2 CPU ranks, fsdp", "",
                 "| run | steps | learning rate | held-out accuracy |", "|---|---:|---:|---:|"]
        lines += [f"| {n} | {s} | {lr} | {100 * acc:.1f} % |" for n, s, lr, acc in learning(a, demo, root)]
        print("\n".join(lines)); Path(a.out).write_text("\n".join(lines) + "\n"); return
    rows = cost(a, demo, root)
    dev = "CUDA, bf16" if a.cuda else "CPU, fp32"
    lines = [f"# LoRA vs full fine-tuning (`bench/bench_lora.py{' --cuda' if a.cuda else ''}{' --learning' if a.learning else ''}`)", "",
             f"{datetime.date.today()}, {a.processes} {dev} processes, fsdp, a {rows[0]['total'] / 1e6:.1f}M-parameter Llama "
             f"(hidden 768, 8 layers, random weights), the demo's chat data, {a.steps} steps of up to 2,048 tokens per rank.", "",
             "| | trains | tokens/s | peak memory per rank (MiB) | training state per rank (MiB) | one checkpoint | final/ |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['trainable']:,} ({100 * r['trainable'] / r['total']:.1f} %) | {r['tokens_per_s']:,.0f} | "
                     f"{r['peak_mb']:,.0f} | {r['state_mb']:,.0f} | {r['ckpt'] / 2**20:.1f} MiB | {r['final'] / 2**20:.1f} MiB |")
    f, l = rows
    lines += ["", f"LoRA / full: tokens/s x{l['tokens_per_s'] / f['tokens_per_s']:.2f}, peak memory x{l['peak_mb'] / f['peak_mb']:.2f}, "
              f"training state x{l['state_mb'] / f['state_mb']:.2f}, "
              f"checkpoint x{l['ckpt'] / f['ckpt']:.3f} (final/ holds the merged model and the adapters)."]
    if a.learning:
        lines += ["", f"## Learning: held-out accuracy on 40 demo conversations, 2 CPU ranks, fsdp", "",
                  "| run | steps | learning rate | held-out accuracy |", "|---|---:|---:|---:|"]
        lines += [f"| {n} | {s} | {lr} | {100 * acc:.1f} % |" for n, s, lr, acc in learning(a, demo, root)]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
