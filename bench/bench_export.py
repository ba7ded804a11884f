"""Peak memory of the GGUF export (`python -m ilab_nb.export`) against the model's size: streaming or loading?

    .venv/bin/python bench/bench_export.py               # ~2.5 minutes on 2 cores, writes results_export.md
    .venv/bin/python bench/bench_export.py --layers 2 --no-write

Random Llamas of 2 and 12 layers (~48M and ~206M parameters: hidden 1024, GQA 16/8 heads, feed-forward 4096, vocab
8192, untied embeddings, so the same largest tensor) are written in bf16 as `save_pretrained` writes one (one
safetensors file) with the demo's tokenizer. Then, each in a fresh process, as a session runs it:

- **baseline**: the same command on the demo's tiny model (the imports, tokenizer and writer; no tensor to speak of);
- **f16** and **q8_0**: the command on each model; on the largest in the order f16, q8_0, q8_0, f16 (the machine is
  shared: the run with the smaller peak is the row, both are printed), once each on the others;
- **for contrast**: a process that loads the whole model the way a non-streaming export would start
  (`AutoModelForCausalLM.from_pretrained(dir, dtype=torch.float32)`), and one that reads the tensors one at a time as
  the export does, but through a memory map of the file (safetensors' `safe_open`), converting each to F32.

Peak RSS is the process's own high-water mark, `VmHWM` (the command prints it in its JSON line; the loading process
prints the same): not `getrusage`'s `ru_maxrss`, which on Linux a child starts with its parent's peak (this script's,
which built the model), seconds the command's own. Streaming shows as a peak a little above the baseline,
bounded by the largest tensor (the 8192 x 1024 embedding: 32 MiB in F32) and its conversion: the same for
both models, where loading grows with the model.
"""
import argparse, datetime, json, os, platform, shutil, subprocess, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}

LOAD = """
import sys, torch
from transformers import AutoModelForCausalLM
from ilab_nb.export import peak_rss_mb
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
print(peak_rss_mb())
"""

MMAP = """
import sys
from safetensors import safe_open
from transformers import AutoTokenizer
from ilab_nb.export import peak_rss_mb
AutoTokenizer.from_pretrained(sys.argv[1])                 # what the export also holds: the baseline's part
with safe_open(sys.argv[1] + "/model.safetensors", framework="pt") as f:
    for k in f.keys(): f.get_tensor(k).float()           # one at a time, as the export, but through the file's map
print(peak_rss_mb())
"""


def build_model(path: Path, layers: int) -> dict:
    "A random bf16 Llama saved as save_pretrained would (config, one safetensors file, the demo's tokenizer)."
    import torch
    from accelerate import init_empty_weights
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from ilab_nb.demo import demo_assets
    cfg = LlamaConfig(vocab_size=8192, hidden_size=1024, intermediate_size=4096, num_hidden_layers=layers,
                      num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=2048,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=5, pad_token_id=0, dtype="bfloat16")
    with init_empty_weights(): shapes = {k: v.shape for k, v in LlamaForCausalLM(cfg).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    tensors = {k: (torch.ones(s) if len(s) == 1 else torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for k, s in shapes.items()}
    path.mkdir(parents=True)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    cfg.architectures = ["LlamaForCausalLM"]; cfg.save_pretrained(path)
    AutoTokenizer.from_pretrained(demo_assets().model_dir).save_pretrained(path)
    params = sum(t.numel() for t in tensors.values())
    largest = max(tensors.items(), key=lambda kv: kv[1].numel())
    return dict(params=params, bytes=(path / "model.safetensors").stat().st_size, largest=largest[0],
                largest_f32_mb=largest[1].numel() * 4 / 2**20)


def export(model_dir: Path, out: Path, dtype: str) -> dict:
    "One `python -m ilab_nb.export` process: its final JSON line."
    p = subprocess.run([sys.executable, "-m", "ilab_nb.export", str(model_dir), str(out), "--dtype", dtype],
                       capture_output=True, text=True, check=True, cwd=ROOT, env=ENV)
    res = json.loads(p.stdout.splitlines()[-1])
    out.unlink()
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(); ap.add_argument("--layers", type=int, nargs="+", default=[2, 12])
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args(argv)
    t0, tmp = time.time(), Path(tempfile.mkdtemp(prefix="bench-export-"))
    from ilab_nb.demo import demo_assets
    base = export(demo_assets().model_dir, tmp / "demo.gguf", "f16")
    print(f"baseline (demo model): {base['peak_rss_mb']} MiB", flush=True)
    sizes = []
    for layers in a.layers:
        model = tmp / f"model-{layers}"; info = build_model(model, layers)
        print(f"model: {info['params'] / 1e6:.0f}M parameters, {info['bytes'] / 2**20:.0f} MiB bf16 on disk; largest tensor "
              f"{info['largest']} ({info['largest_f32_mb']:.0f} MiB in F32)", flush=True)
        runs = {"f16": [], "q8_0": []}
        for dtype in ("f16", "q8_0", "q8_0", "f16") if layers == max(a.layers) else ("f16", "q8_0"):
            runs[dtype].append(r := export(model, tmp / f"m-{dtype}.gguf", dtype))
            print(f"{dtype}: peak {r['peak_rss_mb']} MiB, {r['seconds']} s, {r['bytes'] / 2**20:.0f} MiB file, {r['tensors']} tensors", flush=True)
        load, mapped = (float(subprocess.run([sys.executable, "-c", code, str(model)], capture_output=True, text=True,
                                             check=True, cwd=ROOT, env=ENV).stdout.split()[-1]) for code in (LOAD, MMAP))
        print(f"loading (from_pretrained, float32): peak {load} MiB; mapped reads: peak {mapped} MiB", flush=True)
        sizes.append((info, runs, load, mapped)); shutil.rmtree(model)
    if not a.no_write: write(base, sizes, a, time.time() - t0)


def write(base, sizes, a, seconds):
    mib = lambda b: f"{b / 2**20:,.0f} MiB"
    over = lambda v: f"{v - base['peak_rss_mb']:+,.0f} MiB"
    rows = [("baseline: the demo's tiny model, f16", "-", "-", f"{base['peak_rss_mb']:,.0f} MiB", "-", f"{base['seconds']:.1f} s")]
    for info, runs, load, mapped in sizes:
        name = f"{info['params'] / 1e6:.0f}M, {mib(info['bytes'])} bf16"
        for d, rs in runs.items():
            best = min(rs, key=lambda r: r["peak_rss_mb"])
            rows.append((f"export {d}", name, mib(best["bytes"]), " / ".join(f"{r['peak_rss_mb']:,.0f}" for r in rs) + " MiB",
                         over(best["peak_rss_mb"]), " / ".join(f"{r['seconds']:.1f}" for r in rs) + " s"))
        rows.append(("load it, for contrast (from_pretrained, float32)", name, "-", f"{load:,.0f} MiB", over(load), "-"))
        rows.append(("read it tensor by tensor through a memory map, for contrast", name, "-", f"{mapped:,.0f} MiB", over(mapped), "-"))
    info = sizes[-1][0]
    text = f"""# GGUF export: peak memory against the model's size

`python bench/bench_export.py{' --layers ' + ' '.join(map(str, a.layers)) if a.layers != [2, 12] else ''}`, {datetime.date.today()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, {seconds:.0f} s in all.

Random bf16 Llamas as `save_pretrained` writes them (hidden 1024, feed-forward 4096, vocab 8192, untied: the same
largest tensor, `{info['largest']}`, {info['largest_f32_mb']:.0f} MiB in F32, in every size). Each row is fresh processes of
`python -m ilab_nb.export` (the contrast rows: a process that only loads the model, one that only reads its tensors
one at a time through a memory map of the file and converts each to F32). Peak RSS is the process's own
high-water mark (`VmHWM`; on Linux a child's `getrusage` starts at its parent's peak, here this script's). On the
largest model f16 and q8_0 ran twice each, in the order f16, q8_0, q8_0, f16: both runs are shown, the smaller peak
counts for "over the baseline".

| run | model | GGUF file | peak RSS | over the baseline | export time |
|---|---|---:|---:|---:|---:|
""" + "".join(f"| {' | '.join(r)} |\n" for r in rows) + f"""
The export's peak is the baseline (Python, torch, transformers, the tokenizer) plus a few times the largest tensor
(read as bf16, converted to F32, encoded): the same for a model four times larger, and under the model's own size in
bf16. A process that loads the model holds all of it, in F32 ({mib(info['params'] * 4)} for the largest here). Reading
the same tensors one at a time through a memory map grows with the model too: the mapped file's pages stay resident,
and counted, once read. That is why the export reads each tensor's bytes with plain file reads.
"""
    (ROOT / "bench" / "results_export.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
