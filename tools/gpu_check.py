"""The project's GPU check, one command: what a machine with a CUDA GPU and no network runs from the working tree
(at most 8 minutes on one GPU), stage by stage, going on past a failing stage, into one summary.

    make gpu-wheels                      # where the package index is reachable: wheels the GPU machine lacks -> .gpu-wheels/
    make gpu-check                       # on the GPU machine: installs them into .gpu-site/, runs this, writes gpu-check/
    python tools/gpu_check.py --dry-run  # on CPU: every stage in its CPU form (the test suite runs this)

Stages:
  versions  the libraries and the GPU this runs on; every module ilab_nb needs imports
  pytest    the CUDA tests (`pytest -m cuda tests/test_gpu_paths.py`: varlen kernel in bf16, generation from a packed model,
            LoRA dropout under FSDP's bf16 policy with gradient checkpointing, ddp_timeout in the nccl group)
  runs      a short real run of each CUDA option through FineTuneSession, each with what its header must say: fsdp +
            packed bf16 with eval prompts, single with bf16 autocast, ddp with autocast (two GPUs or more),
            cpu_offload, torch_compile, gradient checkpointing, LoRA adapters, LoRA with gradient checkpointing and
            dropout, DPO on preference pairs, LoRA + DPO, plain text (packed), a CPU fsdp run on the GPU machine, and a
            resume from a checkpoint (the trajectory after it against the uninterrupted run's). Every run with a process
            group must have logged its timeout as ddp_timeout's; the LoRA runs train on a bf16 copy of the demo model,
            and their final/ (merged after the group is gone) must be bf16. Each run's summary has its peak memory (the
            CUDA allocator's) beside the preflight's per-rank estimate, activations included
  bench     bench/bench_gpu.py (a ~1B Llama, FSDP2 bf16, packed vs bucketed): tokens/s, MFU, peak memory; and
            bench/bench_lora.py --cuda (LoRA against a full fine-tune: tokens/s, peak memory, checkpoint size)

In a dry run (no GPU needed) the CUDA tests are only collected, the first run trains on CPU (fp32, 2 steps) and the
others are built and preflighted without starting, and the bench runs `--tiny`: the code of every stage runs.
Writes <out>/summary.md, <out>/summary.json, the runs under <out>/runs and the bench's table <out>/results_gpu.md.
"""
import argparse, json, os, re, shutil, subprocess, sys, time, traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


# What each run sets, and what its metrics header must then say (key: expected value, or a predicate).
RUNS = [
    dict(name="fsdp packed bf16 + eval prompts", fields=dict(strategy="fsdp", precision="bf16", batching="auto",
         eval_prompts=["What is the capital of Nutoland?", "Hi"], eval_steps=3),
         expect=dict(layout="packed", attn_implementation="ilab_packed", mixed_precision=lambda v: (v or {}).get("param_dtype") == "bfloat16",
                     load=lambda v: v.startswith("sharded read")), samples=2),
    dict(name="single, bf16 autocast", fields=dict(strategy="single", precision="bf16", batching="auto"),
         expect=dict(strategy="single", layout="packed", attn_implementation="ilab_packed",
                     mixed_precision=lambda v: (v or {}).get("autocast") == "bfloat16")),
    dict(name="ddp, bf16 autocast", gpus=2, fields=dict(strategy="ddp", precision="bf16", num_processes=2),
         expect=dict(strategy="ddp", world_size=2, mixed_precision=lambda v: (v or {}).get("autocast") == "bfloat16")),
    dict(name="fsdp cpu_offload", fields=dict(strategy="fsdp", precision="bf16", cpu_offload=True),
         expect=dict(cpu_offload=True, backend=lambda v: "gloo" in str(v) and "nccl" in str(v))),
    dict(name="fsdp torch_compile", fields=dict(strategy="fsdp", precision="bf16", torch_compile=True),
         expect=dict(torch_compile="per block"), timeout=300),
    dict(name="fsdp gradient checkpointing", fields=dict(strategy="fsdp", precision="bf16", gradient_checkpointing=True),
         expect=dict(gradient_checkpointing=True)),
    dict(name="fsdp LoRA bf16", base="bf16", fields=dict(strategy="fsdp", precision="bf16", lora=dict(r=8, lora_alpha=16), save_steps=3),
         expect=dict(finetuning="lora", mixed_precision=lambda v: (v or {}).get("param_dtype") == "bfloat16",
                     trainable_params=lambda v: isinstance(v, int) and v > 0), final_dtype="BF16"),
    dict(name="fsdp LoRA + gradient checkpointing + dropout bf16", base="bf16",
         fields=dict(strategy="fsdp", precision="bf16", gradient_checkpointing=True, lora=dict(r=8, lora_alpha=16, lora_dropout=0.1)),
         expect=dict(finetuning="lora", gradient_checkpointing=True, lora=lambda v: (v or {}).get("lora_dropout") == 0.1,
                     mixed_precision=lambda v: (v or {}).get("param_dtype") == "bfloat16"), final_dtype="BF16"),
    dict(name="fsdp DPO bf16", data="pref_", fields=dict(strategy="fsdp", precision="bf16", batching="auto", method="dpo"),
         expect=dict(method="dpo", data_kind="preference", layout="packed", attn_implementation="ilab_packed")),
    dict(name="fsdp LoRA + DPO bf16", data="pref_", base="bf16",
         fields=dict(strategy="fsdp", precision="bf16", batching="auto", method="dpo", lora=dict(r=8, lora_alpha=16)),
         expect=dict(method="dpo", finetuning="lora", data_kind="preference", layout="packed"), final_dtype="BF16"),
    dict(name="fsdp plain text bf16", data="text_", fields=dict(strategy="fsdp", precision="bf16", batching="auto"),
         expect=dict(method="sft", data_kind="text", layout="packed")),
    dict(name="single QLoRA 4-bit + paged 8-bit AdamW", fields=dict(strategy="single", lora=dict(r=8, lora_alpha=16),
         quantization=dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype="bfloat16"),
         optim="paged_adamw_8bit"),
         expect=dict(finetuning="lora", load=lambda v: str(v).startswith("from_pretrained, quantized by bitsandbytes (4-bit nf4)"))),
    dict(name="fsdp QLoRA 4-bit bf16 (the base sharded)", fields=dict(strategy="fsdp", precision="bf16",
         lora=dict(r=8, lora_alpha=16), quantization=dict(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                          bnb_4bit_compute_dtype="bfloat16",
                                                          bnb_4bit_quant_storage="bfloat16")),
         expect=dict(finetuning="lora", load=lambda v: str(v).endswith("(4-bit nf4), sharded by FSDP"))),
    dict(name="fsdp on 2 CPU ranks on a GPU machine", cpu=True, fields=dict(strategy="fsdp", device="cpu", num_processes=2),
         expect=dict(device_type="cpu", backend="gloo", world_size=2)),
]


def log(msg): print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def stage(results, name, fn):
    "Run one stage; record passed/failed/skipped, its seconds and what it found. Never raises."
    t0 = time.time()
    try: out = fn() or {}
    except Skip as e: out = dict(status="skipped", why=str(e))
    except Exception as e:
        out = dict(status="failed", why=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-3000:])
    out.setdefault("status", "passed"); out["seconds"] = round(time.time() - t0, 1)
    results.append(dict(stage=name, **out))
    log(f"{name}: {out['status']} ({out['seconds']} s){': ' + out['why'] if out.get('why') else ''}")
    return out


class Skip(Exception): pass


def versions(a):
    import importlib, importlib.metadata as md
    need = ["torch", "transformers", "accelerate", "datasets", "pydantic", "psutil", "filelock", "yaml", "tqdm", "safetensors",
            "tokenizers", "numpy", "pandas"]
    missing = []
    for m in need:
        try: importlib.import_module(m)
        except ImportError as e: missing.append(f"{m} ({e})")
    out = {}
    for p in ("torch", "transformers", "accelerate", "datasets", "pydantic", "peft"):
        try: out[p] = md.version(p)
        except md.PackageNotFoundError: out[p] = None
    import torch
    out["python"] = sys.version.split()[0]
    out["gpus"] = [dict(name=torch.cuda.get_device_name(i), capability=list(torch.cuda.get_device_capability(i)),
                        memory_gib=round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1))
                   for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    from ilab_nb import batching as B
    out["varlen_kernel"] = B.varlen_available("cuda")
    if missing: raise RuntimeError("missing modules: " + "; ".join(missing) + " (make gpu-wheels where there is network, then make gpu-check)")
    if not a.dry_run and not out["gpus"]: raise RuntimeError("torch sees no CUDA device: run with --dry-run on a CPU machine")
    return dict(found=out)


def run_pytest(a, out_dir):
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", str(ROOT / "tests" / "test_gpu_paths.py"), "-q", "-p", "no:cacheprovider",
           "-rs", f"--junitxml={out_dir / 'pytest.xml'}"] + (["--collect-only"] if a.dry_run else [])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    tail = (r.stdout + r.stderr).strip().splitlines()[-15:]
    if a.dry_run:
        n = sum(1 for l in r.stdout.splitlines() if "::" in l)
        if r.returncode != 0 or n == 0: raise RuntimeError(f"collecting the CUDA tests failed (exit {r.returncode}): " + " | ".join(tail))
        return dict(collected=n, why="dry run: collected only")
    if r.returncode != 0: raise RuntimeError(f"pytest exit {r.returncode}: " + " | ".join(tail))
    return dict(summary=tail[-1])


def check_header(head, expect) -> list:
    "What the header says against what the run expects: a list of mismatches."
    bad = []
    for k, want in expect.items():
        got = head.get(k, "<absent>")
        ok = want(got) if callable(want) else got == want
        if not ok: bad.append(f"{k}={got!r}")
    return bad


def bf16_base(demo, out_dir):
    "The demo model saved in bf16, as released models are (the LoRA runs' base: their final/ must come out bf16)."
    import torch
    from transformers import AutoModelForCausalLM
    d = out_dir / "demo-bf16"
    if not (d / "config.json").exists():
        AutoModelForCausalLM.from_pretrained(demo.model_dir, dtype=torch.bfloat16).save_pretrained(d)
        for f in demo.model_dir.iterdir():
            if f.name.startswith("tokenizer") or f.suffix == ".jinja": shutil.copy(f, d / f.name)
    return d


def group_timeouts(log: str) -> dict:
    "`{backend: seconds}` of the process group, as rank 0 read them back from it and logged them (none without a group)."
    line = next(iter(re.findall(r"collectives time out after (.*)", log)), "")
    return {b: int(t) for t, b in re.findall(r"(\d+) s \((\w+)\)", line)}


def final_dtypes(final) -> list:
    "The dtypes of the tensors in final/'s safetensors files (from their headers)."
    from safetensors import safe_open
    out = set()
    for f in Path(final).glob("*.safetensors"):
        with safe_open(str(f), "pt") as h: out |= {h.get_slice(k).get_dtype() for k in h.keys()}
    return sorted(out)


def one_run(spec, a, demo, data, runs_root, n_gpus):
    from ilab_nb import FineTuneSession
    from ilab_nb.config import TrainConfig
    if spec.get("gpus", 1) > n_gpus and not spec.get("cpu") and not a.dry_run:
        raise Skip(f"needs {spec['gpus']} GPUs, this machine has {n_gpus} (nccl puts one rank on each GPU)")
    fields = {**dict(device="cuda", num_processes=1, max_steps=6, logging_steps=1, learning_rate=3e-3, max_tokens_per_batch=2048,
                     max_seq_len=512), **spec["fields"]}
    cpu_form = a.dry_run and fields.get("device") != "cpu"
    if cpu_form:        # the CPU form of a CUDA run: fp32, no offload or compile, two steps
        fields.update(device="cpu", precision="fp32", cpu_offload=False, torch_compile=False, max_steps=2)
        if fields["strategy"] == "ddp": fields["num_processes"] = 2
    kind = spec.get("data", "")                                        # "" chat, "pref_" preference pairs, "text_" documents
    model = bf16_base(demo, Path(runs_root).parent) if spec.get("base") == "bf16" else demo.model_dir
    s = FineTuneSession(model=str(model), data=str(data[f"{kind}train"]), eval_data=str(data[f"{kind}eval"]), runs_root=runs_root,
                        name=spec["name"].split(",")[0].split()[0], **fields)
    from ilab_nb.rundir import SCHEMA
    unknown = set(spec["expect"]) - set(SCHEMA["header"]["required"]) - set(SCHEMA["header"]["optional"])
    if unknown: raise RuntimeError(f"expects header fields the schema does not have: {sorted(unknown)}")
    if a.dry_run and spec is not RUNS[0]:
        return dict(status="preflighted", why="dry run: built and preflighted on CPU, not started")
    s.start()
    status = s.wait(timeout=spec.get("timeout", 240))
    heads = s.metrics(kinds=("header",))
    head = heads[-1] if heads else {}
    train = s.metrics(kinds=("train",))
    out = dict(run_id=s.run_id, status_of_run=status, steps=len(train), loss=[round(r["loss"], 4) for r in train],
               tokens_per_s=round(train[-1]["tokens_per_s"]) if train else None,
               peak_mem_mb=max(r.get("peak_mem_mb") or 0 for r in train) if train else None,
               # the preflight's per-rank estimate (weights, state, gathered blocks, a full micro-batch's activations)
               # beside that peak (CUDA: the allocator's), to see how far the estimate is from a GPU's own count
               estimate_mb=round(mem["device_bytes"] / 2**20) if (mem := s.preflight.get("memory")) else None,
               activations_mb=round(mem["activations"] / 2**20) if mem else None,
               header={k: head.get(k) for k in ("world_size", "backend", "strategy", "device_type", "precision", "layout",
                                               "attn_implementation", "mixed_precision", "cpu_offload", "torch_compile",
                                               "gradient_checkpointing", "load")})
    if status != "completed":
        raise RuntimeError(f"the run ended {status}: {s.reason or ''} (logs: {s.run_dir / 'logs'})")
    bad = [] if cpu_form else check_header(head, spec["expect"])
    if head.get("backend"):         # a process group: the run's ddp_timeout, as rank 0 read it back from each backend
        want = fields.get("ddp_timeout", TrainConfig.model_fields["ddp_timeout"].default)
        out["group_timeout"] = group_timeouts((s.run_dir / "logs" / "rank-0.log").read_text())
        if not out["group_timeout"] or set(out["group_timeout"].values()) != {want}: bad.append(f"group_timeout={out['group_timeout']}")
    if spec.get("final_dtype"):     # final/ in the base's dtype (a LoRA run's merge)
        out["final_dtypes"] = final_dtypes(s.run_dir / "final")
        if out["final_dtypes"] != [spec["final_dtype"]]: bad.append(f"final/ dtypes={out['final_dtypes']}")
    if spec.get("samples"):
        samples = s.metrics(kinds=("samples",))
        if not samples or len(samples[-1]["samples"]) != spec["samples"]: bad.append(f"samples={samples[-1:] or None}")
        else: out["answers"] = samples[-1]["samples"]
    if bad: raise RuntimeError("the header says " + ", ".join(bad) + f" (run {s.run_id})")
    return out


def resume_run(a, demo, data, runs_root):
    "An uninterrupted run of 4 steps with a checkpoint at 2; the same run resumed from that checkpoint on the same device."
    from ilab_nb import FineTuneSession
    from ilab_nb.launcher import accelerate_command, launch_env, write_accelerate_config
    from ilab_nb.slots import device_request
    from ilab_nb.rundir import RunPaths
    if a.dry_run: raise Skip("dry run: resumes are tested on CPU by tests/test_worker.py")
    s = FineTuneSession(model=str(demo.model_dir), data=str(data["train"]), runs_root=runs_root, name="resume", device="cuda",
                        num_processes=1, strategy="fsdp", precision="bf16", max_steps=4, save_steps=2, logging_steps=1,
                        learning_rate=3e-3, max_tokens_per_batch=2048, max_seq_len=512)
    s.start()
    if s.wait(timeout=240) != "completed": raise RuntimeError(f"the uninterrupted run ended {s.status}: {s.reason}")
    full = {r["step"]: r["loss"] for r in s.metrics(kinds=("train",))}
    rd = Path(runs_root) / "resume-copy"
    (rd / "logs").mkdir(parents=True); (rd / "checkpoints").mkdir()
    shutil.copy(RunPaths(s.run_dir).config, RunPaths(rd).config)
    shutil.copytree(RunPaths(s.run_dir).checkpoint(2), RunPaths(rd).checkpoint(2))
    write_accelerate_config(rd)
    cmd = accelerate_command(rd, {**json.loads(RunPaths(rd).config.read_text()), "device": "cuda"}, attempt=2,
                             resume=str(RunPaths(rd).checkpoint(2)))
    req = device_request("cuda", 1)
    r = subprocess.run(cmd, env=launch_env(rd, req, req["pool"]), capture_output=True, text=True, timeout=240, cwd=rd)
    if r.returncode != 0: raise RuntimeError(f"the resumed worker exited {r.returncode}: {r.stderr[-1500:]}")
    recs = [json.loads(l) for l in RunPaths(rd).metrics.read_text().splitlines() if l.strip()]
    again = {x["step"]: x["loss"] for x in recs if x["kind"] == "train"}
    diff = max(abs(again[k] - full[k]) for k in (3, 4))
    out = dict(loss_uninterrupted=[full[k] for k in (3, 4)], loss_resumed=[again.get(k) for k in (3, 4)], max_abs_diff=diff)
    if sorted(again) != [3, 4] or diff > 1e-2: raise RuntimeError(f"the resumed trajectory differs: {out}")
    return out


def run_bench(a, out_dir):
    cmd = [sys.executable, str(ROOT / "bench" / "bench_gpu.py"), "--out", str(out_dir / "results_gpu.md")] + (["--tiny"] if a.dry_run else [])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=420, cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])})
    if r.returncode != 0: raise RuntimeError(f"bench_gpu.py exit {r.returncode}: {r.stderr[-1500:]}")
    rows = [l for l in (out_dir / "results_gpu.md").read_text().splitlines() if l.startswith("| packed") or l.startswith("| bucketed")]
    return dict(table=rows)


def run_bench_lora(a, out_dir):
    "bench/bench_lora.py --cuda: LoRA against a full fine-tune on every local GPU (the CPU table is bench/results_lora.md)."
    if a.dry_run: raise Skip("dry run: its CPU form is `python bench/bench_lora.py` (bench/results_lora.md)")
    out = out_dir / "results_lora_gpu.md"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_lora.py"), "--cuda", "--out", str(out)], capture_output=True,
                       text=True, timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                           [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])})
    if r.returncode != 0: raise RuntimeError(f"bench_lora.py exit {r.returncode}: {r.stderr[-1500:]}")
    return dict(table=[l for l in out.read_text().splitlines() if l.startswith("| full") or l.startswith("| LoRA")])


def summary_md(results, a) -> str:
    lines = [f"# GPU check{' (dry run on CPU)' if a.dry_run else ''}: `python tools/gpu_check.py{' --dry-run' if a.dry_run else ''}`",
             "", f"{time.strftime('%Y-%m-%d %H:%M')}, {sum(r['status'] == 'passed' for r in results)} passed, "
             + (f"{sum(r['status'] == 'preflighted' for r in results)} only preflighted, " if a.dry_run else "") +
             f"{sum(r['status'] == 'failed' for r in results)} failed, {sum(r['status'] == 'skipped' for r in results)} skipped, "
             f"{sum(r['seconds'] for r in results):.0f} s.", "", "| stage | status | s | what it found |", "|---|---|---|---|"]
    for r in results:
        found = {k: v for k, v in r.items() if k not in ("stage", "status", "seconds", "trace", "table")}
        lines.append(f"| {r['stage']} | {r['status']} | {r['seconds']} | {json.dumps(found, default=str)[:600]} |")
    for r in results:
        if r.get("table"): lines += ["", f"{r['stage']}:", "", "| layout | attention | tokens/s | MFU | FLOPs/token | s | peak GiB | load | mixed precision |",
                                     "|---|---|---|---|---|---|---|---|---|"] + r["table"]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="on CPU: each stage in its CPU form")
    ap.add_argument("--out", default=str(ROOT / "gpu-check"), help="where the summary, runs and bench table go")
    ap.add_argument("--stages", default="versions,pytest,runs,bench", help="comma-separated subset")
    a = ap.parse_args(argv)
    out_dir = Path(a.out).absolute(); out_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("ILAB_NB_LOCKS", str(out_dir / "locks"))      # this check's own device slots
    os.environ.setdefault("OMP_NUM_THREADS", "4")
    want, results = a.stages.split(","), []
    if "versions" in want: stage(results, "versions", lambda: versions(a))
    if "pytest" in want: stage(results, "pytest -m cuda", lambda: run_pytest(a, out_dir))
    if "runs" in want:
        from ilab_nb.demo import demo_assets
        import torch
        demo = demo_assets(out_dir / "demo")
        data = {}
        for k, f, n in (("train", demo.train_file, 64), ("eval", demo.eval_file, 16), ("pref_train", demo.pref_train_file, 64),
                        ("pref_eval", demo.pref_eval_file, 16), ("text_train", demo.text_train_file, 64),
                        ("text_eval", demo.text_eval_file, 8)):
            data[k] = out_dir / f"{k}.jsonl"
            with open(f) as src: data[k].write_text("".join(src.readline() for _ in range(n)))
        n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        runs_root = out_dir / "runs"
        for spec in RUNS: stage(results, f"run: {spec['name']}", lambda spec=spec: one_run(spec, a, demo, data, runs_root, n_gpus))
        stage(results, "run: resume from a checkpoint", lambda: resume_run(a, demo, data, runs_root))
    if "bench" in want: stage(results, "bench_gpu.py" + (" --tiny" if a.dry_run else ""), lambda: run_bench(a, out_dir))
    if "bench" in want: stage(results, "bench_lora.py --cuda", lambda: run_bench_lora(a, out_dir))
    (out_dir / "summary.json").write_text(json.dumps(results, indent=1, default=str))
    (out_dir / "summary.md").write_text(summary_md(results, a))
    print(summary_md(results, a))
    return 1 if any(r["status"] == "failed" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
