"""Benchmark of ilab_nb.batching on CPU, one thread: loss-bearing tokens per second of training steps with
(a) naive random-order padded batches, (b) length-bucketed plans, (c) packed rows, all at the same per-batch
token budget, on a tiny random Llama and a long-tailed synthetic length distribution.

    .venv/bin/python bench/bench_batching.py            # ~1-2 minutes; writes bench/results_batching.md
    .venv/bin/python bench/bench_batching.py --samples 100 --no-write   # quick smoke run
"""
import argparse, datetime, os, platform, sys, time
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the repository's ilab_nb, installed or not
from ilab_nb.batching import batch_cost, collate, linear_token_loss_sum, plan_epoch, plan_stats, token_loss_sum


def long_tail_lengths(n, seed, lo=16, hi=1024):
    "Lognormal token lengths (median ~150) clipped to lo..hi, like chat data: many short samples, a long tail."
    return np.clip(np.random.default_rng(seed).lognormal(5.0, 0.8, n), lo, hi).astype(int).tolist()


def make_samples(lengths, vocab, seed):
    "Random token ids; the first third of each sample is a prompt without loss (labels -100)."
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        out.append(dict(input_ids=ids, labels=[-100] * (n // 3) + ids[n // 3:]))
    return out


def naive_plan(lengths, max_tokens, seed):
    "Random order; a padded batch grows until one more sample would take rows x longest over max_tokens."
    plan, batch = [], []
    for i in np.random.default_rng(seed).permutation(len(lengths)).tolist():
        if batch and batch_cost([lengths[j] for j in batch + [i]], "bucketed") > max_tokens:
            plan.append([batch]); batch = []
        batch.append(i)
    return plan + [[batch]] if batch else plan


def train_epoch(model, opt, samples, plan, layout, loss_kind="logits"):
    "One training step (forward, backward, optimizer step) per micro-batch; returns (seconds, loss tokens, mean loss)."
    loss_tokens, losses = 0, []
    t0 = time.perf_counter()
    for step in plan:
        (batch_idx,) = step                      # world_size 1
        b = collate([samples[i] for i in batch_idx], layout, pad_id=0)
        n = int(b["num_loss_tokens"])
        kw = dict(input_ids=b["input_ids"], position_ids=b["position_ids"], attention_mask=b["attention_mask"], use_cache=False)
        if loss_kind == "chunked":          # the worker's loss: from the final hidden states, never all float32 logits
            loss = linear_token_loss_sum(model.model(**kw).last_hidden_state, model.lm_head.weight, b["labels"]) / max(n, 1)
        else:
            loss = token_loss_sum(model(**kw).logits, b["labels"]) / max(n, 1)
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
        loss_tokens += n; losses.append(loss.item())
    return time.perf_counter() - t0, loss_tokens, float(np.mean(losses))


def cpu_name():
    try:
        return next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=150)
    ap.add_argument("--max-tokens", type=int, default=2048, help="per-batch token budget (rows x longest, or row length)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-write", action="store_true", help="print only; do not write bench/results_batching.md")
    args = ap.parse_args()
    torch.set_num_threads(1)

    cfg = LlamaConfig(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=1000, max_position_embeddings=2048, attn_implementation="sdpa")
    lengths = long_tail_lengths(args.samples, args.seed)
    samples = make_samples(lengths, cfg.vocab_size, args.seed)
    plans = {
        "naive random padded": ("bucketed", naive_plan(lengths, args.max_tokens, args.seed)),
        "length-bucketed plan": ("bucketed", plan_epoch(lengths, args.max_tokens, 1, "bucketed", args.seed, 0)),
        "packed rows (sdpa)": ("packed", plan_epoch(lengths, args.max_tokens, 1, "packed", args.seed, 0)),
    }
    # the worker's loss since issue 8 (chunked, from hidden states) beside the full-logits loss, same plans, same run
    plans["length-bucketed, chunked loss"] = plans["length-bucketed plan"]
    plans["packed rows (sdpa), chunked loss"] = plans["packed rows (sdpa)"]
    loss_of = lambda name: "chunked" if name.endswith("chunked loss") else "logits"
    runs = {}
    for name, (layout, plan) in plans.items():
        torch.manual_seed(args.seed)
        model = LlamaForCausalLM(cfg).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        train_epoch(model, opt, samples, plan[:2], layout, loss_of(name))  # warm-up, not timed
        runs[name] = dict(model=model, opt=opt, secs=[])
    # the machine is shared: run the epochs in the order a b c c b a and keep each one's faster epoch
    order = list(plans) + list(plans)[::-1]
    for rep, name in enumerate(order):
        layout, plan = plans[name]
        secs, loss_tokens, _ = train_epoch(runs[name]["model"], runs[name]["opt"], samples, plan, layout, loss_of(name))
        runs[name]["secs"].append(secs); runs[name]["loss_tokens"] = loss_tokens
        print(f"epoch {rep + 1}/{len(order)}  {name:34s} {secs:6.1f} s  {loss_tokens / secs:8.0f} loss tokens/s", flush=True)
    rows = []
    for name, (layout, plan) in plans.items():
        st, r = plan_stats(plan, lengths, layout), runs[name]
        secs = min(r["secs"])
        rows.append(dict(name=name, steps=len(plan), real=st["real_tokens"], computed=st["computed_tokens"],
                         eff=st["efficiency"], secs=secs, all_secs=r["secs"], loss_tokens=r["loss_tokens"],
                         tps=r["loss_tokens"] / secs))

    base = rows[0]["tps"]
    header = ("| batching | micro-batches | real tokens | computed tokens | efficiency | seconds (both epochs) | "
              "loss tokens | loss tokens/s (faster epoch) | vs naive |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    table = "\n".join([header] + [
        f"| {r['name']} | {r['steps']} | {r['real']:,} | {r['computed']:,} | {r['eff']:.3f} | {' / '.join(f'{x:.1f}' for x in r['all_secs'])} | "
        f"{r['loss_tokens']:,} | {r['tps']:,.0f} | {r['tps'] / base:.2f}x |" for r in rows])
    n_params = sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())
    setup = (f"{datetime.date.today()}, {cpu_name()}, torch {torch.__version__} with 1 thread, transformers "
             f"{transformers.__version__}, load average {os.getloadavg()[0]:.2f} at the end (2 cores shared).\n"
             f"Model: random Llama, hidden 128, 4 layers, 4 heads, vocab 1000 ({n_params / 1e6:.2f}M parameters), "
             f"sdpa attention. One training step (forward, backward, AdamW) per micro-batch; two epochs per "
             f"batching, run in the order a b c d e e d c b a after 2 warm-up micro-batches each; the faster epoch counts.\nData: {args.samples} samples, lognormal lengths (median ~150) clipped to "
             f"16..1024, mean {np.mean(lengths):.0f}, max {max(lengths)}; the first third of each sample carries no "
             f"loss. 'chunked loss': the worker's loss (batching.linear_token_loss_sum, from the final hidden states) instead of "
             f"cross-entropy over the full float32 logits, on the same plan. Token budget per micro-batch: {args.max_tokens} (naive: random order, a batch grows until "
             f"rows x longest would exceed the budget).")
    print("\n" + table + "\n\n" + setup)
    if not args.no_write:
        out = Path(__file__).with_name("results_batching.md")
        out.write_text(f"# Batching benchmark (measured by `bench/bench_batching.py`)\n\n{setup}\n\n{table}\n")
        print(f"\nwrote {out}")


if __name__ == "__main__":
    sys.exit(main())
