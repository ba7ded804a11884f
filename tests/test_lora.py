"""LoRA adapters for real: a 2-rank FSDP run through FineTuneSession (adapters only in every checkpoint, the merged
model in final/, equal logits), resumed from its middle checkpoint (the same trajectory and adapters), and the same
run under DDP (the adapters gathered from FSDP's shards equal a replica's); its final model and a checkpoint exported as
GGUF and read back by transformers and llama.cpp."""
import importlib.util, json, os, shutil, subprocess, sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ilab_nb import FineTuneSession
from ilab_nb.launcher import accelerate_command, write_accelerate_config
from ilab_nb.rundir import RunPaths

from conftest import runs_env, within, max_abs_diff

pytestmark = pytest.mark.processes

LORA = dict(r=8, lora_alpha=16)
FIELDS = dict(num_processes=2, device="cpu", max_steps=6, save_steps=3, logging_steps=1, learning_rate=1e-2,
              max_tokens_per_batch=1024, max_seq_len=256, batching="bucketed", seed=3, lora=LORA,
              eval_prompts=["What is the capital of Nutoland?"], eval_steps=3, eval_max_new_tokens=6)


def _losses(run_dir):
    recs = [json.loads(l) for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if l.strip()]
    return {r["step"]: r["loss"] for r in recs if r["kind"] == "train"}, [r for r in recs if r["kind"] == "header"]


def _adapter(folder):
    with safe_open(str(Path(folder) / "adapter_model.safetensors"), "pt") as f: return {k: f.get_tensor(k) for k in f.keys()}


def _worker(rd, extra=()):
    write_accelerate_config(rd)
    cmd = accelerate_command(rd, {"num_processes": 2, "device": "cpu"})[:-2] + list(extra or ("--attempt", "1"))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:] + "".join(p.read_text()[-2000:] for p in sorted((rd / "logs").glob("rank-*.log")))


@pytest.fixture(scope="module")
def lora_run(demo, small_train, tmp_path_factory):
    "The 2-rank FSDP LoRA run, through the whole product (preflight, supervisor, accelerate launch)."
    root = tmp_path_factory.mktemp("lora")
    with pytest.MonkeyPatch.context() as mp:                      # the module's runs: their own root, locks, 2 slots
        for k, v in runs_env(root).items(): mp.setenv(k, v)
        s = FineTuneSession(model=str(demo.model_dir), data=str(small_train), strategy="fsdp", **FIELDS)
        s.start()
        assert s.wait(timeout=600) == "completed", s.reason
        yield s


def test_fsdp_lora_trains_adapters_only_and_merges_after(lora_run, demo):
    from transformers import AutoModelForCausalLM
    from peft import PeftModel
    s, paths = lora_run, RunPaths(lora_run.run_dir)
    losses, heads = _losses(s.run_dir)
    h = heads[0]
    assert (h["finetuning"], h["strategy"], h["world_size"]) == ("lora", "fsdp", 2)
    assert h["lora"]["r"] == 8 and len(h["lora"]["target_modules"]) == 7
    assert 0 < h["trainable_params"] < 0.2 * h["params_total"]
    assert sum(h["params_per_rank"]) == h["params_total"] and max(h["params_per_rank"]) < 0.6 * h["params_total"]
    base_bytes = sum(f.stat().st_size for f in Path(demo.model_dir).glob("*.safetensors"))
    for step in (3, 6):
        ck = paths.checkpoint(step)
        assert not list(ck.glob("model*.safetensors"))                          # no copy of the base
        keys = list(_adapter(ck))
        assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys)
        import torch.distributed.checkpoint as dcp
        saved = dcp.FileSystemReader(str(ck / "distributed")).read_metadata().state_dict_metadata
        model_keys = [k for k in saved if k.startswith("model.")]
        assert model_keys and all("lora_" in k for k in model_keys)           # sharded state: the adapters only
        size = sum(f.stat().st_size for f in ck.rglob("*") if f.is_file())
        assert size < base_bytes                                              # adapters, optimizer and RNG < the base alone
    # final/: the merged model, loadable without peft, equal to the base with the adapters
    merged = AutoModelForCausalLM.from_pretrained(paths.final, dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(demo.model_dir, dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, paths.final / "adapter").eval()
    ids = torch.randint(6, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(): lm, la = merged(input_ids=ids).logits, adapted(input_ids=ids).logits
    within("LoRA final/ (merged) logits vs peft's PeftModel on the base", max_abs_diff(lm, la), 1e-4, "4.8e-7")
    with torch.no_grad(): lb = AutoModelForCausalLM.from_pretrained(demo.model_dir, dtype=torch.float32)(input_ids=ids).logits
    assert (la - lb).abs().max() > 1e-3                                       # the adapters trained
    model, tok = s.load_model(checkpoint=3)                                   # a checkpoint: the adapters on their base
    assert hasattr(model, "peft_config") and tok.pad_token_id is not None
    assert not hasattr(s.load_model()[0], "peft_config")                      # final/: the merged model
    assert losses and all(v == v for v in losses.values())
    # eval_prompts answered by the adapted model at every evaluation (generation through peft's wrapper under FSDP)
    samples = [json.loads(l) for l in paths.metrics.read_text().splitlines() if '"samples"' in l]
    samples = [r for r in samples if r["kind"] == "samples"]
    assert [r["step"] for r in samples] == [0, 3, 6] and all(isinstance(r["samples"][0]["answer"], str) for r in samples)


def test_resume_restores_all_of_the_adapters_and_the_trajectory(lora_run, tmp_path):
    "The resume that restored 1/N of an adapter in other tools: here the steps after it and the adapters are the same."
    src = RunPaths(lora_run.run_dir)
    rd = tmp_path / "resumed"; (rd / "logs").mkdir(parents=True); (rd / "checkpoints").mkdir()
    shutil.copy(src.config, RunPaths(rd).config)
    shutil.copytree(src.checkpoint(3), RunPaths(rd).checkpoint(3))
    _worker(rd, ("--resume", str(RunPaths(rd).checkpoint(3)), "--attempt", "2"))
    full, _ = _losses(lora_run.run_dir)
    again, heads = _losses(rd)
    assert heads[0]["resumed_from_step"] == 3 and sorted(again) == [4, 5, 6]
    for k in (4, 5, 6): assert abs(again[k] - full[k]) <= 1e-4 * max(1.0, abs(full[k])), (k, again[k], full[k])
    a, b = _adapter(src.final / "adapter"), _adapter(RunPaths(rd).final / "adapter")
    assert set(a) == set(b)
    for k in a: torch.testing.assert_close(b[k], a[k], atol=1e-6, rtol=1e-5)


def test_adapters_gathered_from_fsdp_shards_equal_a_ddp_replica(lora_run, tmp_path):
    "The same steps under DDP (every rank a whole replica): the adapters FSDP's ranks saved from their shards are the same."
    rd = tmp_path / "ddp"; (rd / "logs").mkdir(parents=True)
    cfg = json.loads(RunPaths(lora_run.run_dir).config.read_text())
    cfg.update(strategy="ddp", save_steps=None)
    RunPaths(rd).config.write_text(json.dumps(cfg))
    _worker(rd)
    a, b = _adapter(RunPaths(lora_run.run_dir).final / "adapter"), _adapter(RunPaths(rd).final / "adapter")
    assert set(a) == set(b) and len(a) == 2 * 7 * 4                           # A and B of 7 layers in 4 blocks
    for k in a: torch.testing.assert_close(b[k], a[k], atol=1e-5, rtol=1e-4)
    fsdp, _ = _losses(lora_run.run_dir); ddp, heads = _losses(rd)
    assert heads[0]["strategy"] == "ddp" and heads[0]["finetuning"] == "lora"
    for k in fsdp: assert abs(ddp[k] - fsdp[k]) <= 1e-4 * abs(fsdp[k]), (k, ddp[k], fsdp[k])


@pytest.fixture(scope="module")
def final_f32(lora_run):
    """`final/` (merged) exported as f32 GGUF through the session, to its default place: exported once (an export is a
    process of its own that imports torch), read by transformers and by llama.cpp below."""
    return lora_run.export(dtype="f32", progress=False)


def test_final_and_a_checkpoint_exported_as_gguf(lora_run, final_f32, demo):
    """The LoRA run's model in llama.cpp's format: `final/` (merged) through the session, the step-3 checkpoint (its
    adapters only, merged onto their base for the export) too. Transformers' GGUF reader gives the
    logits of the merged model and of the base with the step-3 adapters (1e-5)."""
    from transformers import AutoModelForCausalLM
    from peft import PeftModel
    s, paths, final = lora_run, RunPaths(lora_run.run_dir), final_f32
    assert final == paths.root / "export" / f"{s.run_id}-final-f32.gguf" and final.modelfile.exists()
    ck = s.export(dtype="f32", checkpoint=3, progress=False)             # (ilab-nb export's own: tests/test_export.py)
    assert ck == paths.root / "export" / f"{s.run_id}-step-00000003-f32.gguf" and ck.with_suffix(".Modelfile").exists()
    assert sorted(p.name for p in (paths.root / "export").iterdir()) == sorted(
        [final.name, final.modelfile.name, ck.name, ck.with_suffix(".Modelfile").name])        # no merged folder left
    ids = torch.randint(6, 200, (2, 24), generator=torch.Generator().manual_seed(1))
    read = lambda f: AutoModelForCausalLM.from_pretrained(f.parent, gguf_file=f.name, dtype=torch.float32).eval()
    base = lambda: AutoModelForCausalLM.from_pretrained(demo.model_dir, dtype=torch.float32)
    with torch.no_grad():
        want_final = AutoModelForCausalLM.from_pretrained(paths.final, dtype=torch.float32).eval()(input_ids=ids).logits
        want_ck = PeftModel.from_pretrained(base(), paths.checkpoint(3)).eval()(input_ids=ids).logits
        got_final, got_ck = read(final)(input_ids=ids).logits, read(ck)(input_ids=ids).logits
    within("transformers' GGUF reader: the LoRA final/ f32 file's logits", max_abs_diff(got_final, want_final), 1e-5, "0.0")
    within("transformers' GGUF reader: the LoRA step-3 f32 file's logits vs peft", max_abs_diff(got_ck, want_ck), 1e-5, "9.5e-7")
    assert (want_ck - want_final).abs().max() > 1e-3                          # two different models were exported


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed: the llama.cpp "
                    "reader checks need it (`make llama-deps` builds it once per machine)")
def test_final_gguf_read_by_llama_cpp(lora_run, final_f32):
    """llama.cpp reads the LoRA run's merged model from its GGUF file (the one transformers' reader read above) with the
    merged model's logits (1e-4: its own kernels)."""
    import llama_cpp
    from transformers import AutoModelForCausalLM
    f = final_f32
    ids = torch.randint(6, 200, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(RunPaths(lora_run.run_dir).final, dtype=torch.float32)(input_ids=ids).logits[0]
    llm = llama_cpp.Llama(str(f), logits_all=True, n_ctx=64, n_threads=1, verbose=False, type_k=0, type_v=0)
    try: llm.eval(ids[0].tolist()); got = torch.tensor(llm.scores[:ids.shape[1]])
    finally: llm.close()
    within("llama.cpp: the LoRA final/ f32 file's logits vs transformers", max_abs_diff(got, want), 1e-4, "7.2e-7")
