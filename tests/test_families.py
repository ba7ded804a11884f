"""Every model family of `ilab_nb.demo.FAMILIES`: a tiny random model of each, trained full and with LoRA adapters
(finite losses that fall, LoRA's step 1 the base's loss, a final/ that loads with no missing or unexpected key, differs
from the base and, for LoRA, equals base + adapters); a Mixture of Experts with LoRA on 2 ranks, forked from its middle
checkpoint onto 1 process (the same trajectory); DPO on a Mixture of Experts; a file whose weight was renamed after the
preflight, refused before step 1 with the weight named; a NaN loss at step 2 failing the run there, then a resume that
skips one.

What depends on the family is the rank's work: reading the family's weights (renamed, fused experts), wrapping it in
FSDP, peft's adapters, the steps, `final/` written back in the family's names. So the 24 family runs are made by
`FineTuneSession` (its preflight, run directory and config.json) and trained by the worker's own `run()` in this
process, as rank 0 of 1: the same code a launched rank runs, without the launch, the supervisor and a fresh
interpreter per run, which are the same for every family and are what every other process test here runs (the MoE
run on 2 ranks and the NaN test's failing 2-rank run below run in the background; the MoE fork onto 1 process, the NaN
run's resume onto 1, the renamed-weight run and the DPO run are trained here, the same way)."""
import json, math, shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ilab_nb import FineTuneSession
from ilab_nb.demo import FAMILIES, family_model
from ilab_nb.lora import load_adapted
from ilab_nb.rundir import RunPaths, State

from conftest import REPO, kill_processes_under, runs_env, fork_here, train_here, within, max_abs_diff

pytestmark = pytest.mark.processes

FIELDS = dict(num_processes=1, strategy="fsdp", device="cpu", max_seq_len=256, max_tokens_per_batch=1024,
              logging_steps=1, learning_rate=3e-3, seed=1)
# 4 steps each (the test asks the loss to fall by 0.01), on FAMILY_ROWS rows: measured over the 12 families, full
# fine-tuning's fell by 0.52 (phi3) to 0.69 (gpt_neox), LoRA's (at 1e-2, as tests/test_lora.py's) by 0.16 (qwen3_moe)
# to 0.36 (gpt_neox). (On all 200 rows, LoRA at 3e-3 fell by 0.046 to 0.175; on 64 rows at 3e-3, by 0.017 only.)
MODES = {"full": dict(max_steps=4), "lora": dict(max_steps=4, lora=dict(r=4), learning_rate=1e-2)}
MOE = ("qwen3_moe", "mixtral")


def train_losses(s) -> dict:
    return {r["step"]: r["loss"] for r in s.metrics() if r.get("kind") == "train"}


def header(s) -> dict:
    return s.metrics(kinds=("header",))[0]


FAMILY_ROWS = 64     # small_train's first rows (about 7,300 tokens) for the family runs: 4 steps of 1,024 use fewer,
#                      and a run tokenizes all its rows twice (the preflight's check, the rank's data set): on 200 rows
#                      that was about half of a family run's time (cProfile, qwen2 full and LoRA)


@pytest.fixture(scope="module")
def families(demo, small_train, tmp_path_factory):
    "`{(family, mode): (session, outcome)}`: every family's full and LoRA run, each trained in this process."
    root = tmp_path_factory.mktemp("families")
    data = root / "train.jsonl"
    with open(small_train) as f: data.write_text("".join(next(f) for _ in range(FAMILY_ROWS)))
    with pytest.MonkeyPatch.context() as mp:
        for k, v in runs_env(root).items(): mp.setenv(k, v)
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"): mp.delenv(k, raising=False)
        runs = {}
        for f in FAMILIES:
            model = family_model(f, root / "models" / f, demo)
            for mode, kw in MODES.items():
                s = FineTuneSession(model=str(model), data=str(data), **{**FIELDS, **kw})
                runs[f, mode] = s, train_here(s)
    lines = [f"{f:12} {m:4} {out:9} {header(s)['attn_implementation']:6} loss "
             + " -> ".join(f"{v:.3f}" for v in list(train_losses(s).values())[::max(1, len(train_losses(s)) - 1)])
             + f"  trainable {header(s)['trainable_params']:,} of {header(s)['params_total']:,}  {header(s)['load']}"
             for (f, m), (s, out) in runs.items()]
    (REPO / "artifacts").mkdir(exist_ok=True)
    (REPO / "artifacts" / "families.txt").write_text("\n".join(lines) + "\n")     # git-ignored, for inspection
    return runs


def _logits(model_dir_or_model, ids):
    from transformers import AutoModelForCausalLM
    m = (AutoModelForCausalLM.from_pretrained(model_dir_or_model, dtype=torch.float32)
         if isinstance(model_dir_or_model, (str, Path)) else model_dir_or_model)
    with torch.no_grad(): return m.eval()(input_ids=ids).logits


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_trains_full_and_lora(families, family):
    from transformers import AutoModelForCausalLM
    (full, done_full), (lora, done_lora) = families[family, "full"], families[family, "lora"]
    for mode, s, done in (("full", full, done_full), ("lora", lora, done_lora)):
        assert done == "completed" and RunPaths(s.run_dir).final.is_dir(), (family, mode, done)
        losses = list(train_losses(s).values())
        assert len(losses) == MODES[mode]["max_steps"] and all(math.isfinite(x) for x in losses), losses
        assert losses[-1] < losses[0] - 0.01, (family, mode, losses)
        h = header(s)
        assert h["attn_implementation"] == ("eager" if family == "gemma2" else "sdpa"), h["attn_implementation"]
        assert h["load"].startswith("sharded read"), h["load"]       # every family: each rank reads its slices
    # the adapters start at zero: LoRA's first step is the base model's loss on the same batch
    assert abs(train_losses(lora)[1] - train_losses(full)[1]) <= 1e-5 * train_losses(full)[1]
    if family in MOE:                                                  # the fused experts and the router adapted, and trained
        assert header(lora)["lora"]["target_parameters"] and header(lora)["lora"]["adapted_parameters"] > 0
        ad = load_file(RunPaths(lora.run_dir).final / "adapter" / "adapter_model.safetensors")
        experts = [v for k, v in ad.items() if ".experts." in k and "lora_B" in k]
        assert experts and all(float(v.abs().max()) > 0 for v in experts)
        assert "fused" in header(full)["load"]
    if family == "gpt_neox": assert "1 renamed" in header(full)["load"]
    base_dir = Path(full.config.model)
    ids = torch.randint(6, 700, (2, 20), generator=torch.Generator().manual_seed(0))
    base = _logits(base_dir, ids)
    for s in (full, lora):
        final = RunPaths(s.run_dir).final
        _, info = AutoModelForCausalLM.from_pretrained(final, output_loading_info=True)
        assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
        got = _logits(final, ids)
        assert torch.isfinite(got).all() and (got - base).abs().max() > 1e-4      # trained: not the base any more
    adapted = _logits(load_adapted(RunPaths(lora.run_dir).final / "adapter", base_model=str(base_dir)), ids)
    within(f"{family}: LoRA final/ (merged) logits vs peft's adapters on the base",               # merged = base + adapters
           max_abs_diff(adapted, _logits(RunPaths(lora.run_dir).final, ids)), 1e-4, "5.1e-7 over 12 families")


def test_moe_lora_on_two_ranks_then_a_fork_on_one_goes_on_the_same_trajectory(demo, small_train, runs_root, tmp_path,
                                                                              monkeypatch):
    """A Qwen3-MoE with LoRA on 2 ranks (each reads its experts), and a fork of its step-2 checkpoint on 1 process with 2
    accumulation steps (the same global batch), trained here as rank 0 of 1 (`fork_here`). The dense family on 2 ranks
    with a resume is the demo Llama's, in tests/test_lineage.py (resumed on 1 process, then forked back onto 2)."""
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"): monkeypatch.delenv(k, raising=False)
    model = family_model("qwen3_moe", tmp_path / "moe", demo)
    s = FineTuneSession(model=str(model), data=str(small_train), **{**FIELDS, "num_processes": 2}, max_steps=4,
                        save_steps=2, lr_scheduler_type="constant", lora=dict(r=4))
    s.start()
    assert s.wait(timeout=600) == State.completed, s.reason
    h = header(s)
    assert h["world_size"] == 2 and max(h["params_per_rank"]) < h["params_total"]     # sharded
    f, done = fork_here(s, step=2, num_processes=1, gradient_accumulation_steps=2)
    assert done == State.completed, done
    a, b = train_losses(s), train_losses(f)
    assert sorted(b) == [3, 4] and all(abs(a[k] - b[k]) <= 1e-4 * abs(a[k]) for k in b), (a, b)
    assert "fused" in header(s)["load"] and header(f)["trainable_params"] == header(s)["trainable_params"]


def test_dpo_on_a_mixture_of_experts(demo, runs_root, tmp_path, monkeypatch):
    "DPO with LoRA on a mixture of experts, trained here as rank 0 of 1 (DPO and MoE on two ranks: their own tests)."
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"): monkeypatch.delenv(k, raising=False)
    model = family_model("qwen3_moe", tmp_path / "moe", demo)
    # 64 of the demo's 800 pairs: a run tokenizes all its pairs and computes the reference's log-probabilities of each
    # (10.8 CPU-s against 14.0 on all 800). The last step's margin: 4.6e-4 here (8.8e-5 on all 800)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(Path(demo.pref_train_file).read_text().splitlines(keepends=True)[:64]))
    s = FineTuneSession(model=str(model), data=str(pairs), method="dpo", beta=0.1, lora=dict(r=4),
                        **{**FIELDS, "max_tokens_per_batch": 1024, "max_seq_len": 256}, max_steps=4)
    assert train_here(s) == State.completed
    recs = [r for r in s.metrics() if r.get("kind") == "train"]
    assert abs(recs[0]["loss"] - math.log(2)) < 1e-4              # the policy starts as its reference: sigmoid(0)
    assert all(math.isfinite(r["loss"]) for r in recs) and recs[-1]["rewards/margins"] > 0


def test_a_weight_renamed_after_the_preflight_fails_the_run_before_step_1(demo, small_train, runs_root, tmp_path,
                                                                        monkeypatch):
    """Trained here as rank 0 of 1: the rank's own error, in its account (the supervisor's reason from a rank's error:
    the NaN test's below)."""
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"): monkeypatch.delenv(k, raising=False)
    model = tmp_path / "model"; shutil.copytree(demo.model_dir, model)
    s = FineTuneSession(model=str(model), data=str(small_train), **FIELDS, max_steps=2)
    sd = load_file(model / "model.safetensors")                    # the preflight passed; now the files change
    sd["model.layers.1.mlp.up_projx.weight"] = sd.pop("model.layers.1.mlp.up_proj.weight")
    save_file(sd, model / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(Exception) as e:
        try: train_here(s)
        finally:
            if torch.distributed.is_initialized(): torch.distributed.destroy_process_group()
    assert "model.layers.1.mlp.up_proj.weight" in str(e.value) and "before step 1" in str(e.value), e.value
    assert not train_losses(s) and not list(RunPaths(s.run_dir).checkpoints.glob("step-*"))
    acct = json.loads(RunPaths(s.run_dir).rank_account(0).read_text())
    assert acct["status"] == "failed" and "model.layers.1.mlp.up_proj.weight" in acct["error"], acct


def test_a_nan_loss_fails_the_run_at_its_step_then_a_resume_skips_one(demo, small_train, runs_root, monkeypatch):
    # tests/nan_worker.py makes the second step of each attempt NaN, through the real forward and backward
    import os
    from functools import partial
    import ilab_nb.session as session_mod
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setattr(session_mod, "spawn_supervisor", partial(session_mod.spawn_supervisor, worker_module="nan_worker"))
    s = FineTuneSession(model=str(demo.model_dir), data=str(small_train), **{**FIELDS, "num_processes": 2}, max_steps=4,
                        save_steps=1)
    s.start()
    assert s.wait(timeout=600) == State.failed
    assert ("NonFiniteError: loss became nan and grad_norm became nan at step 2: the update was not applied, and the run "
            "stops rather than train on it; its last good checkpoint is step-00000001") in s.reason, s.reason
    assert s.state["failed_rank"] in (0, 1) and list(train_losses(s)) == [1]     # both ranks stop with the same error
    assert [c["step"] for c in s.checkpoints] == [1] and not RunPaths(s.run_dir).final.exists()
    # from that checkpoint, skipping such steps: the resumed attempt's second step (3) is skipped, the run completes.
    # The attempt is `resume()`'s own (its config and checkpoint), trained here as rank 0 of 1 with nan_worker's fault
    # planted in this process for it alone: its launch would be a supervisor and one more interpreter that imports
    # torch, as the failed attempt's was (a resume launched in the background: tests/test_lineage.py's)
    import ilab_nb.worker as W
    spawned, train_step = {}, W.Attempt.train_step
    with monkeypatch.context() as mp:
        mp.setattr(W.Attempt, "train_step", train_step)              # nan_worker's import replaces it: put back after
        import nan_worker
        mp.setattr(W.Attempt, "train_step", nan_worker._nan_on_the_second_step)      # this attempt's second step NaN
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"): mp.delenv(k, raising=False)
        mp.setattr(FineTuneSession, "_spawn", lambda self, attempt, resume=None: spawned.update(a=attempt, r=resume))
        mp.setattr(nan_worker, "_calls", [0])
        s.resume(skip_nonfinite_steps=True, num_processes=1, gradient_accumulation_steps=2)   # the same global batch
        try: done = W.run(RunPaths(s.run_dir), resume=spawned["r"], attempt=spawned["a"])
        finally:
            if torch.distributed.is_initialized(): torch.distributed.destroy_process_group()
    assert W.Attempt.train_step is train_step and done == State.completed, done
    assert s.progress()["skipped_steps"] == [3] and sorted(train_losses(s)) == [1, 2, 4]
    skipped = [r for r in s.metrics(kinds=("event",)) if r["event"] == "skipped"]
    assert [r["step"] for r in skipped] == [3] and "the step was skipped (skip_nonfinite_steps)" in skipped[0]["error"]
    ids = torch.randint(6, 700, (1, 16), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(_logits(RunPaths(s.run_dir).final, ids)).all()
