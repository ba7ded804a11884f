"""The worker, for real: `accelerate launch` with 2 CPU processes (gloo), FSDP2 sharding, resume (on two "machines"
of one process each), a single process, FSDP on one process, and the config fields whose effect can be seen cheaply in
the files a run writes. The runs train on `small_train` (200 conversations; the shortest runs on its first 96);
one-process checks run the worker inside pytest (`in_process=True`), where a process of its own would add nothing.
(DDP's replicated parameters are checked on the DDP run of tests/test_session.py::test_queue_and_stop.)"""
import json, os, subprocess, sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from ilab_nb.config import TrainConfig
from ilab_nb import worker
from ilab_nb.launcher import accelerate_command, free_port, write_accelerate_config
from ilab_nb.rundir import RunPaths

pytestmark = pytest.mark.timeout(600)


def make_run(tmp_path, demo, data, name, **fields) -> Path:
    rd = tmp_path / name
    (rd / "logs").mkdir(parents=True)
    base = dict(model=str(demo.model_dir), data=[str(data)], device="cpu", max_tokens_per_batch=1024,
                max_seq_len=256, learning_rate=3e-3, logging_steps=1, seed=7)
    TrainConfig(**{**base, **fields}).to_json(rd / "config.json")
    return rd


def launch(rd: Path, nproc: int, *extra, expect_ok=True, in_process=False):
    """Start the worker the way the launcher does (ARCHITECTURE.md), wait, and return the process result.
    `in_process=True` runs a one-process worker inside pytest (same `run()`, without the interpreter start-up; a
    process group of one, FSDP's, is destroyed afterwards as the worker's `main()` does)."""
    if in_process:
        assert nproc == 1 and not extra
        try: return worker.run(RunPaths(rd))
        finally:
            if dist.is_available() and dist.is_initialized(): dist.destroy_process_group()
    if nproc > 1:       # the launcher's own command line and neutral accelerate config (conftest's default is hostile)
        write_accelerate_config(rd)
        cmd = accelerate_command(rd, {"num_processes": nproc, "device": "cpu"})[:-2] + list(extra or ("--attempt", "1"))
    else:
        cmd = [sys.executable, "-m", "ilab_nb.worker", str(rd), *extra]
    tmp = rd.parent / "tmp"                  # the launch's temporary directory: where torch's agent used to leave its logs
    tmp.mkdir(exist_ok=True)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "ILAB_NB_RECORD_DATA_SEEN": "1",   # the data_seen probe
                            "TMPDIR": str(tmp)})
    logs = "\n".join(p.read_text()[-3000:] for p in sorted((rd / "logs").glob("rank-*.log")))
    if expect_ok: assert r.returncode == 0, f"worker failed ({r.returncode}):\n{r.stderr[-3000:]}\n{logs}"
    return r


def launch_machines(rd: Path, **kw):
    """Two "machines" without SLURM: two `accelerate launch` groups on 127.0.0.1 (the config's num_machines=2, one
    process each, gloo on CPU), built by the launcher's own `accelerate_command` (`kw`: its attempt and resume); each
    group's output in logs/machine-<rank>.log."""
    d = {**TrainConfig.read_json(rd / "config.json").model_dump(mode="json"), "device": "cpu"}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ILAB_NB_RUN_DIR": str(rd)}
    (rd / "checkpoints").mkdir(exist_ok=True)             # as RunStore.create_run makes it
    write_accelerate_config(rd)           # what the supervisor writes before a launch: no user default config applies
    machines = []
    for rank in (1, 0):      # the second machine first: it must wait for the first at the rendezvous
        cmd = accelerate_command(rd, {**d, "machine_rank": rank}, **kw)
        assert cmd[cmd.index("--machine_rank") + 1] == str(rank) and cmd[cmd.index("--num_processes") + 1] == "2"
        with open(rd / "logs" / f"machine-{rank}.log", "w") as log:
            machines.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=rd))
    codes = [p.wait(timeout=600) for p in machines]
    logs = "\n".join(p.read_text()[-2000:] for p in sorted((rd / "logs").glob("*.log")))
    assert codes == [0, 0], logs


@pytest.fixture(scope="module")
def few_rows(small_train, tmp_path_factory):
    """small_train's first 96 conversations (about 11,000 tokens: 6 steps of 1,024) for the one-process runs of 1 or 2
    steps: a run tokenizes all its rows, and 200 were a third of a 2-step run's time."""
    p = tmp_path_factory.mktemp("few_rows") / "train.jsonl"
    with open(small_train) as f: p.write_text("".join(next(f) for _ in range(96)))
    return p


def records(rd: Path, kind=None):
    recs = [json.loads(l) for l in (rd / "metrics.jsonl").read_text().splitlines() if l.strip()]
    return [r for r in recs if kind is None or r["kind"] == kind]


@pytest.mark.processes
def test_fsdp_two_ranks_shard_split_data_checkpoint_and_resume_on_the_same_trajectory(tmp_path, demo, small_train):
    """One FSDP run of 2 ranks (8 steps, all in the first epoch of small_train at 512 tokens per rank) proves sharding,
    split data, metrics, evaluation, whole checkpoints and final/; a second run of the same config resumed from its
    step-4 checkpoint proves resume: same seed, same data position, restored optimizer/scheduler/RNG, same losses.
    The optimizer is AdamW's fused kernel (optim='adamw_torch_fused'), on FSDP's sharded parameters. The resumed run
    is launched as two "machines" without SLURM (`launch_machines`: num_machines=2, one process each), which shard it
    and train it to its end: a launch of its own would be the same 2 gloo ranks with one more launcher."""
    fields = dict(num_processes=2, strategy="fsdp", max_steps=8, save_steps=4, eval_split=0.05, max_tokens_per_batch=512,
                  lr_scheduler_type="cosine", warmup_steps=2, optim="adamw_torch_fused")
    rd = make_run(tmp_path, demo, small_train, "fsdp", **fields)
    launch(rd, 2)
    head = records(rd, "header")[0]
    assert (head["world_size"], head["backend"], head["strategy"], head["distributed_type"]) == (2, "gloo", "fsdp", "MULTI_CPU")
    total, per_rank = head["params_total"], head["params_per_rank"]
    assert len(per_rank) == 2 and sum(per_rank) == total
    assert all(abs(n - total / 2) / total < 0.05 for n in per_rank), per_rank      # each rank holds about half
    done = [r for r in records(rd, "event") if r["event"] == "completed"][0]
    seen = done["data_seen"]
    assert all(n > 0 for n in seen["per_rank"]) and seen["shared"] == 0, seen     # different data on each rank
    train = records(rd, "train")
    assert [r["step"] for r in train] == list(range(1, 9))
    assert all(r["grad_norm"] > 0 and r["tokens"] > 0 and 0 < r["efficiency"] <= 1 for r in train)
    assert len(records(rd, "eval")) == 2                                           # before training and at the end
    # both ranks wrote their own log; checkpoints are whole, Hugging Face loadable, and final/ exists
    assert (rd / "logs" / "rank-0.log").exists() and (rd / "logs" / "rank-1.log").exists()
    # torch's elastic agent kept its folder of the launch in the run (a folder per rank), none in the temporary directory
    assert sorted(p.name for p in RunPaths(rd).elastic_logs.glob("*/attempt_0/*")) == ["0", "1"]
    assert not list((tmp_path / "tmp").glob("torchelastic_*"))
    ckpts = sorted(p.name for p in (rd / "checkpoints").iterdir())
    assert ckpts == ["step-00000004", "step-00000008"], ckpts
    for c in ckpts:
        assert (rd / "checkpoints" / c / "COMPLETE").exists() and (rd / "checkpoints" / c / "distributed" / ".metadata").exists()
    m = AutoModelForCausalLM.from_pretrained(rd / "final")
    assert m.config.use_cache                 # trained without a KV cache, saved for generation with one
    m8 = AutoModelForCausalLM.from_pretrained(rd / "checkpoints" / "step-00000008")
    m0 = AutoModelForCausalLM.from_pretrained(demo.model_dir)
    for (k, a), b, c in zip(m.state_dict().items(), m8.state_dict().values(), m0.state_dict().values()):
        assert torch.equal(a, b), k
    assert any(not torch.equal(a, c) for a, c in zip(m.state_dict().values(), m0.state_dict().values()))

    # resume, on two "machines": a new attempt from the step-4 checkpoint follows the uninterrupted run's trajectory
    b = make_run(tmp_path, demo, small_train, "b", **fields, num_machines=2, main_process_ip="127.0.0.1",
                 main_process_port=free_port(), rdzv_backend="c10d")
    launch_machines(b, resume=rd / "checkpoints" / "step-00000004", attempt=2)
    head = records(b, "header")[0]
    assert head["resumed_from_step"] == 4 and head["attempt"] == 2
    assert (head["world_size"], head["backend"], head["num_machines"], len(head["nodes"])) == (2, "gloo", 2, 2), head
    total, per_rank = head["params_total"], head["params_per_rank"]
    assert len(per_rank) == 2 and sum(per_rank) == total and all(abs(n - total / 2) / total < 0.05 for n in per_rank)
    la = {r["step"]: r for r in train}
    lb = {r["step"]: r for r in records(b, "train")}
    assert sorted(lb) == [5, 6, 7, 8]
    for s in lb:
        assert abs(lb[s]["loss"] - la[s]["loss"]) <= 1e-4 * abs(la[s]["loss"]), (s, lb[s]["loss"], la[s]["loss"])
        assert lb[s]["learning_rate"] == pytest.approx(la[s]["learning_rate"], rel=1e-9)
    assert records(b)[-1]["event"] == "completed" and (b / "final" / "config.json").exists()
    assert sorted(p.name for p in (b / "checkpoints").iterdir()) == ["step-00000008"]


def test_one_process_runs_single_or_fsdp(tmp_path, demo, few_rows):
    rd1 = make_run(tmp_path, demo, few_rows, "single", num_processes=1, strategy="single", max_steps=2)
    launch(rd1, 1, in_process=True)
    assert records(rd1, "header")[0]["world_size"] == 1 and (rd1 / "final" / "model.safetensors").exists()
    # FSDP on one process (a group of one, as for one GPU with cpu_offload) trains like the single process
    rd2 = make_run(tmp_path, demo, few_rows, "fsdp1", num_processes=1, strategy="fsdp", max_steps=2)
    launch(rd2, 1, in_process=True)
    head = records(rd2, "header")[0]
    assert head["strategy"] == "fsdp" and head["world_size"] == 1 and head["backend"] == "gloo"
    assert [r["loss"] for r in records(rd2, "train")] == pytest.approx([r["loss"] for r in records(rd1, "train")], rel=1e-4)
    assert list((rd2 / "final").glob("*.safetensors"))


@pytest.mark.processes
def test_asked_for_processes_not_in_effect_fails_loudly(tmp_path, demo, small_train):
    # num_processes=2 but started as one plain process: the silent single-process fallback is refused.
    rd = make_run(tmp_path, demo, small_train, "wrong", num_processes=2, strategy="fsdp", max_steps=2)
    r = launch(rd, 1, expect_ok=False)
    assert r.returncode != 0
    log = (rd / "logs" / "rank-0.log").read_text()
    assert "num_processes=2 was asked for, but 1 process(es) are in effect" in log
    assert records(rd, "event")[-1]["event"] == "failed"


def test_fields_are_honoured(tmp_path, demo, small_train):
    """Single-process runs (cheap) in which each field's effect shows in the files."""
    common = dict(num_processes=1, strategy="single")
    # learning_rate, warmup_steps, lr_scheduler_type, max_steps, logging_steps, eval_steps, save_steps,
    # save_total_limit, gradient_checkpointing
    rd = make_run(tmp_path, demo, small_train, "f1", **common, max_steps=8, learning_rate=1e-3, warmup_steps=4,
                  lr_scheduler_type="linear", logging_steps=2, eval_split=0.05, eval_steps=4, save_steps=2,
                  save_total_limit=2, gradient_checkpointing=True)
    launch(rd, 1, in_process=True)
    head, train = records(rd, "header")[0], records(rd, "train")
    assert head["total_steps"] == 8 and head["gradient_checkpointing"] is True     # read off the model's blocks
    assert [r["step"] for r in train] == [2, 4, 6, 8]
    lrs = [r["learning_rate"] for r in train]          # lr after the step: warmup to 1e-3 at step 4, linear to 0
    assert lrs == pytest.approx([0.5e-3, 1e-3, 0.5e-3, 0.0])
    assert [r["step"] for r in records(rd, "eval")] == [0, 4, 8]
    assert sorted(p.name for p in (rd / "checkpoints").iterdir()) == ["step-00000006", "step-00000008"]
    # seed: same seed, same losses; gradient_accumulation_steps: half the steps, twice the tokens per step
    r2 = make_run(tmp_path, demo, small_train, "f2", **common, max_steps=4, gradient_accumulation_steps=2, num_train_epochs=1)
    r3 = make_run(tmp_path, demo, small_train, "f3", **common, max_steps=4, gradient_accumulation_steps=2, num_train_epochs=1)
    r4 = make_run(tmp_path, demo, small_train, "f4", **common, max_steps=4, gradient_accumulation_steps=1, num_train_epochs=1)
    for r in (r2, r3, r4): launch(r, 1, in_process=True)
    assert records(r4, "header")[0]["gradient_checkpointing"] is False
    t2, t3, t4 = records(r2, "train"), records(r3, "train"), records(r4, "train")
    assert [x["loss"] for x in t2] == [x["loss"] for x in t3]
    assert sum(x["tokens"] for x in t2) > 1.7 * sum(x["tokens"] for x in t4)
    # max_grad_norm: a tiny clip norm leaves the model (and so the loss) almost where it started
    r5 = make_run(tmp_path, demo, small_train, "f5", **common, max_steps=4, max_grad_norm=1e-9, learning_rate=1e-2)
    launch(r5, 1, in_process=True)
    l5 = [x["loss"] for x in records(r5, "train")]
    assert abs(l5[-1] - l5[0]) < 0.02 * l5[0] and abs(t4[-1]["loss"] - t4[0]["loss"]) > 0.05 * t4[0]["loss"]


def test_long_sequence_policy_and_token_budget(tmp_path, demo, few_rows):
    common = dict(num_processes=1, strategy="single", max_steps=1)
    drop = make_run(tmp_path, demo, few_rows, "drop", **common, max_seq_len=48, long_sequence_policy="drop")
    trunc = make_run(tmp_path, demo, few_rows, "trunc", **common, max_seq_len=48, long_sequence_policy="truncate")
    small = make_run(tmp_path, demo, few_rows, "small", **common, max_tokens_per_batch=256)
    for r in (drop, trunc, small): launch(r, 1, in_process=True)
    sd, st = records(drop, "header")[0]["data_stats"]["train"], records(trunc, "header")[0]["data_stats"]["train"]
    assert sd["dropped_too_long"] > 0 and sd["truncated"] == 0
    assert st["truncated"] > 0 and st["max_length"] <= 48 and st["samples"] > sd["samples"]
    assert sd["note"].startswith(f"{sd['dropped_too_long']:,} samples of {sd['records']:,} were longer than max_seq_len=48 tokens "
                                 f"and dropped (the longest has {sd['longest']:,} tokens)") and sd["longest"] > 48
    assert st["note"].startswith(f"{st['truncated'] + st['dropped_too_long']:,} samples of {st['records']:,} were longer than "
                                 "max_seq_len=48 tokens and truncated")
    # a smaller per-rank token budget means more, smaller micro-batches
    big = make_run(tmp_path, demo, few_rows, "big", **common, max_tokens_per_batch=1024)
    launch(big, 1, in_process=True)
    assert records(small, "train")[0]["tokens"] < records(big, "train")[0]["tokens"]
    assert records(small, "header")[0]["plan"]["computed_tokens"] <= 256


def test_packed_layout_gives_the_same_loss_as_bucketed(tmp_path, demo, few_rows):
    """`batching` is honoured: the packed layout (one row, position_ids restarting per sequence, no attention
    mask) and the bucketed one (padded rows) evaluate the same held-out samples to the same mean token loss,
    because packed sequences do not see each other."""
    common = dict(num_processes=1, strategy="single", max_steps=1, max_tokens_per_batch=512, eval_split=0.05)
    packed = make_run(tmp_path, demo, few_rows, "packed", **common, batching="packed")
    bucketed = make_run(tmp_path, demo, few_rows, "bucketed", **common, batching="bucketed")
    for r in (packed, bucketed): launch(r, 1, in_process=True)
    hp, hb = records(packed, "header")[0], records(bucketed, "header")[0]
    assert (hp["layout"], hb["layout"]) == ("packed", "bucketed")
    ep, eb = records(packed, "eval")[0], records(bucketed, "eval")[0]
    assert ep["step"] == eb["step"] == 0 and ep["eval_tokens"] == eb["eval_tokens"] > 0
    assert ep["eval_loss"] == pytest.approx(eb["eval_loss"], rel=1e-5)


def test_lora_final_is_merged_by_rank0_after_the_group_is_gone_in_the_base_dtype(tmp_path, demo, few_rows, monkeypatch):
    """A one-process FSDP LoRA run in this process (a group of one, as on one GPU): the group holds the run's
    `ddp_timeout` (read back from its backend as the group is destroyed); the adapters are merged only after that, when
    no rank can be waiting in a collective; and final/ is in the base's dtype (a bf16 copy of the demo model: bf16 files,
    the size of the base, not float32's twice)."""
    from ilab_nb import lora as L
    from safetensors import safe_open
    base = tmp_path / "base-bf16"
    AutoModelForCausalLM.from_pretrained(demo.model_dir, dtype=torch.bfloat16).save_pretrained(base)
    for f in demo.model_dir.iterdir():
        if f.name.startswith("tokenizer") or f.suffix == ".jinja": (base / f.name).write_bytes(f.read_bytes())
    events, destroy, merge = [], dist.destroy_process_group, L.merge_adapter
    def destroy_spy(*a, **kw): events.append(("destroy", worker.group_timeout())); return destroy(*a, **kw)
    def merge_spy(*a, **kw): events.append(("merge", dist.is_initialized())); return merge(*a, **kw)
    monkeypatch.setattr(dist, "destroy_process_group", destroy_spy)
    monkeypatch.setattr(L, "merge_adapter", merge_spy)
    rd = make_run(tmp_path, demo, few_rows, "lora1", model=str(base), num_processes=1, strategy="fsdp", max_steps=2,
                  lora=dict(r=4, lora_alpha=8, lora_dropout=0.1), ddp_timeout=1234)
    assert launch(rd, 1, in_process=True) == "completed"
    assert events == [("destroy", {"gloo": 1234.0}), ("merge", False)], events
    with safe_open(str(rd / "final" / "model.safetensors"), "pt") as f: dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"BF16"}, dtypes
    size = lambda d: (d / "model.safetensors").stat().st_size
    assert abs(size(rd / "final") - size(base)) < 0.01 * size(base)
    assert records(rd)[-1]["event"] == "completed" and (rd / "final" / "adapter" / "adapter_model.safetensors").exists()
