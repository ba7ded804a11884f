"""GRPO for real, as cheaply as it can be proven: the loss and TRL's metrics against TRL's own `GRPOTrainer` on the same
prompts, completions and rewards (fed to both, in this process, per loss_type); one 2-rank FSDP run started from a
"kernel" (a process whose `__main__` defines the reward function) that exits at once, the run surviving it, with
held-out evaluations and num_iterations=2 (each generation batch trained on twice); its fork at step 1 (inside a
generation batch) from this process (a new kernel), stopped by `stop()` at step 3 (inside the next one) and resumed by
`ilab-nb resume` (another new process), training on the same batches as the uninterrupted run;
its model exported and evaluated by lm-eval on its held-out prompts; one in-process LoRA run against the reference and one
whose reward raises; a sweep of two one-step runs over reward_weights; reward functions named in a YAML config; and the
demo model's held-out expected reward raised by a few GRPO steps."""
import json, math, os, subprocess, sys
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ilab_nb import grpo as G
from ilab_nb.config import TrainConfig
from ilab_nb.demo import read_chat_jsonl, shipped_data_dir
from ilab_nb.rundir import RunPaths
from ilab_nb.usercode import UserCode

from conftest import cli_env, ilab, kill_processes_under, runs_env, within

try: import trl
except ImportError: trl = None
import platform
platform.processor()      # runs `uname -p` once per process (GRPOTrainer asks for it): at import, not inside a test

pytestmark = pytest.mark.timeout(600)

NUM_GEN, COMP_LEN = 4, 6


def answer_word(prompts, completions, answer, **kw):
    "1.0 for the right answer (the first word, case-insensitive), None where the row has no answer."
    text = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [None if a is None else float(t.strip().split(" ")[0].lower() == a.lower()) for t, a in zip(text, answer)]


def short(prompts, completions, **kw):
    "A format reward: shorter answers score higher."
    text = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 / (1 + len(t)) for t in text]


def _prompts(n, offset=0):
    "Capital, currency and animal questions of the shipped demo data, as GRPO prompt rows with their answers."
    rows = []
    for c in read_chat_jsonl(shipped_data_dir() / "eval.jsonl")[offset:]:
        i = next(i for i, m in enumerate(c) if m["role"] == "assistant")
        rows.append({"prompt": c[:i], "answer": c[i]["content"]})
        if len(rows) == n: break
    return rows


def _fixed_completions(tok, n_rows, seed=0):
    "Completion token lists as TRL's sampler leaves them: up to and including the first EOS, or truncated at COMP_LEN."
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n_rows):
        ids = torch.randint(10, tok.vocab_size, (COMP_LEN,), generator=g).tolist()
        if k % 3 != 2: ids = ids[:1 + k % COMP_LEN] + [tok.eos_token_id]      # every third one truncated
        out.append(ids[:COMP_LEN])
    return out


# --- the loss and the metrics, against TRL's GRPOTrainer ------------------------------------------------------------

CASES = [dict(loss_type="dapo", beta=0.04, scale_rewards="batch", epsilon_high=0.28), dict(loss_type="dr_grpo"),
         dict(loss_type="bnpo", num_iterations=2),
         dict(loss_type="grpo", scale_rewards="none", mask_truncated_completions=True)]

# Tolerances, from the largest differences measured by this test over the four cases (trl 1.16, torch 2.13 CPU,
# float32, on the 2-core build machine): advantages 0 (the same operations), loss 3.0e-8 relative (bnpo; dapo 0,
# dr_grpo 1.5e-8, grpo 3.7e-9), metrics 3.1e-7 absolute (the entropy: TRL's chunked output layer against the full
# logits), num_iterations=2's old log-probabilities 4.8e-7 absolute (the same cause). The loss's tolerance is 3.4x, the
# metrics' 16x and the old log-probabilities' 10x the measured difference: never within issue 37's 2x.
SEEN = "trl 1.16 / torch 2.13 CPU fp32: advantages 0, loss 3.0e-8 rel., metrics 3.1e-7 abs., old log-probs 4.8e-7"
ADV_TOL, LOSS_TOL, METRIC_TOL = 1e-6, 1e-7, 5e-6


def _trl_trainer(demo, tmp_path, rows, comps, kw):
    "TRL's GRPOTrainer on the demo model, its sampler replaced by the fixed completions `comps`."
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer

    class Fixed(trl.GRPOTrainer):
        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
            return [list(c) for c in comps], None

    args = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), num_generations=NUM_GEN, per_device_train_batch_size=2 * NUM_GEN,
                          max_completion_length=COMP_LEN, report_to=[], use_cpu=True, bf16=False, reward_weights=[1.0, 0.5],
                          **kw)
    model = AutoModelForCausalLM.from_pretrained(demo.model_dir, dtype=torch.float32)
    data = datasets.Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"] or ""} for r in rows])
    tr = Fixed(model=model, reward_funcs=[answer_word, short], args=args,
               processing_class=AutoTokenizer.from_pretrained(demo.model_dir), train_dataset=data)
    tr.model.train()
    tr.current_gradient_accumulation_steps = 1
    return tr


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_grpo_agrees_with_trl(demo, tmp_path, case):
    """The same 2 prompts x 4 completions fed to TRL's `GRPOTrainer` (its sampler replaced by the fixed completions)
    and to ilab_nb's reward, advantage, log-probability and loss code: the advantages, the loss and every metric agree;
    with num_iterations=2, TRL's old log-probabilities (the sampling policy's) are ours. The old log-probabilities are
    shifted so that clipping happens; the reference's (beta > 0) too."""
    if trl is None: pytest.skip("trl is not installed")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(demo.model_dir)
    rows = _prompts(2)
    rows[1]["answer"] = None                                  # a None reward for one function
    comps = _fixed_completions(tok, 2 * NUM_GEN)
    comps[0] = tok(rows[0]["answer"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]   # one right answer
    kw = dict(beta=0.0, epsilon=0.2, epsilon_high=None, scale_rewards="group", mask_truncated_completions=False) | case
    tr = _trl_trainer(demo, tmp_path, rows, comps, kw)
    out = tr._generate_and_score_completions([r for r in rows for _ in range(NUM_GEN)])
    old = out.get("old_per_token_logps")             # num_iterations > 1: the sampling policy's, computed by TRL
    shift = torch.linspace(-0.4, 0.4, out["completion_ids"].numel()).view_as(out["completion_ids"].float())
    with torch.no_grad():
        lp, _, _ = tr._get_per_token_logps_and_entropies(
            tr.model, torch.cat([out["prompt_ids"], out["completion_ids"]], 1),
            torch.cat([out["prompt_mask"], out["completion_mask"]], 1), COMP_LEN)
    out["old_per_token_logps"] = lp + shift
    if kw["beta"]: out["ref_per_token_logps"] = lp - shift.flip(0)
    theirs_loss = float(tr._compute_loss(tr.model, out).detach())
    theirs = {k: v[-1] for k, v in tr._metrics["train"].items()}

    # ilab_nb's code on the same completions
    cfg = SimpleNamespace(max_completion_length=COMP_LEN, **kw)
    prompts = [r["prompt"] for r in rows for _ in range(NUM_GEN)]
    completions = [[{"role": "assistant", "content": t}] for t in tok.batch_decode(comps, skip_special_tokens=True)]
    call = dict(prompts=prompts, completions=completions, completion_ids=comps,
                answer=[r["answer"] for r in rows for _ in range(NUM_GEN)])
    rpf = torch.tensor([[math.nan if v is None else v for v in f(**call)] for f in (answer_word, short)]).T
    adv, rewards, zero = G.advantages(rpf, torch.tensor([1.0, 0.5]), NUM_GEN, kw["scale_rewards"])
    ours = {**G.reward_metrics(rpf, rewards, zero, ["answer_word", "short"]),
            **G.completion_stats(torch.tensor([len(c) for c in comps]), torch.tensor([c[-1] != tok.eos_token_id for c in comps]))}
    mask, truncated = G.completion_mask(out["completion_ids"], tok.eos_token_id)
    if kw["mask_truncated_completions"]: mask = mask * (~truncated).unsqueeze(1).int()
    assert torch.equal(mask, out["completion_mask"].int())
    batch = dict(prompt_ids=out["prompt_ids"], prompt_mask=out["prompt_mask"], completion_ids=out["completion_ids"],
                 completion_mask=mask)
    model2 = AutoModelForCausalLM.from_pretrained(demo.model_dir, dtype=torch.float32).train()
    env = SimpleNamespace(device=torch.device("cpu"), world_size=1)
    logps, ent = G.model_forward(model2, batch, env, nullcontext,
                                 G.completion_logps(out["prompt_ids"].shape[1], out["completion_ids"], 1.0))
    assert (old is not None) == (kw.get("num_iterations", 1) > 1)
    if old is not None:                               # ours (add_old) are the same forward's, without the graph
        within(f"GRPO {kw['loss_type']}: old log-probabilities of the completion tokens, max |ilab_nb - TRL|",
               ((logps.detach() - old) * mask).abs().max(), METRIC_TOL, SEEN)
    loss, m = G.policy_loss(logps, out["old_per_token_logps"], adv, mask, cfg, out.get("ref_per_token_logps"), ent,
                            out["num_items_in_batch"].float(), 1, None)
    ours.update(m)
    name = kw["loss_type"]
    within(f"GRPO {name}: advantages, max |ilab_nb - TRL|", (adv - out["advantages"]).abs().max(), ADV_TOL, SEEN)
    within(f"GRPO {name}: loss, |ilab_nb - TRL| / max(1, |TRL|)", abs(float(loss) - theirs_loss) / max(1.0, abs(theirs_loss)),
           LOSS_TOL, SEEN)
    names = set(theirs) - {"num_tokens"}
    assert names <= set(ours), names - set(ours)
    both_nan = {k for k in names if math.isnan(ours[k]) and math.isnan(theirs[k])}
    assert all(not math.isnan(ours[k]) and not math.isnan(theirs[k]) for k in names - both_nan), (ours, theirs)
    within(f"GRPO {name}: {len(names)} metrics, max |ilab_nb - TRL|",
           max(abs(ours[k] - theirs[k]) for k in names - both_nan), METRIC_TOL, SEEN)
    assert 0 < theirs["clip_ratio/region_mean"] < 1       # the shifted old log-probabilities clip some tokens


# --- one 2-rank FSDP run from a kernel that exits, and its fork from a new one --------------------------------------

KERNEL = '''
import json, os, sys
from ilab_nb import FineTuneSession

def letters(prompts, completions, trainer_state, log_metric, log_extra, **kw):
    """Defined in this kernel's __main__: the training processes cannot import it (it reaches them saved by value).
    It logs as TRL's reward functions may: the steps done and its rank (averaged over the ranks), each count."""
    counts = [sum(ch.isalpha() for ch in c[0]["content"]) for c in completions]
    log_metric("steps_done", trainer_state.global_step); log_metric("rank", int(os.environ.get("RANK", 0)))
    log_extra("letter_count", counts)
    return [n / 8 for n in counts]

s = FineTuneSession(model=sys.argv[1], data=sys.argv[2], reward_funcs=[letters], **json.loads(sys.argv[3]))
s.start()
print(s.run_id)          # and the kernel is gone: the run goes on in the background
'''

GRPO_RUN = dict(method="grpo", num_processes=2, strategy="fsdp", device="cpu", max_steps=4, save_steps=1, logging_steps=1,
                learning_rate=2e-3, num_generations=4, per_device_train_batch_size=4, max_completion_length=8,
                max_seq_len=256, num_completions_to_print=4, seed=3, beta=0.04, eval_steps=3, num_iterations=2)
SAMPLED = (1, 3)       # the steps that sample a generation batch; steps 2 and 4 train on it again
HELD_OUT = 5           # held-out prompts: 3 on rank 0 and 2 on rank 1, which answers one more it does not count


def _records(rd, kind):
    return [r for r in map(json.loads, RunPaths(rd).metrics.read_text().splitlines()) if r["kind"] == kind]


def letters_stopping_once(marker: Path):
    """`letters`, which also asks its run to stop, with `stop()` from the training process as a click in the notebook
    would: the first time a training process of a run scores completions (ILAB_NB_RUN_DIR names the run), once."""
    def letters(prompts, completions, **kw):
        run_dir = os.environ.get("ILAB_NB_RUN_DIR")
        if run_dir and not marker.exists():
            marker.touch()
            from ilab_nb import FineTuneSession
            FineTuneSession.attach(Path(run_dir).name, Path(run_dir).parent).stop(wait=False)
        return [sum(ch.isalpha() for ch in c[0]["content"]) / 8 for c in completions]
    return letters


@pytest.fixture(scope="module")
def grpo_run(demo, tmp_path_factory):
    """A 2-rank FSDP GRPO run of 4 steps, 2 generation batches (num_iterations=2; beta > 0: the starting shards swapped
    in; held-out evaluations at steps 0, 3 and 4), started by a kernel process that exits at once, its reward a function
    of that kernel's `__main__`; then, from this process, its fork at step 1 (inside the first batch), stopped with a
    checkpoint at step 3 (inside the second) and resumed by `ilab-nb resume`."""
    from ilab_nb import FineTuneSession
    root = tmp_path_factory.mktemp("grpo")
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _prompts(16)))
    (root / "held_out.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _prompts(HELD_OUT, offset=100)))
    env = cli_env(**runs_env(root))
    with pytest.MonkeyPatch.context() as mp:
        for k, v in runs_env(root).items(): mp.setenv(k, v)
        try:
            (root / "kernel.py").write_text(KERNEL)       # its __main__ has source, as a notebook's cells have
            cfg = {**GRPO_RUN, "eval_data": str(root / "held_out.jsonl")}
            k = subprocess.run([sys.executable, str(root / "kernel.py"), str(demo.model_dir), str(root / "prompts.jsonl"),
                                json.dumps(cfg)], capture_output=True, text=True, timeout=300, env=env)
            assert k.returncode == 0, k.stderr[-3000:]
            s = FineTuneSession.attach(k.stdout.split()[-1])         # a new kernel: the session's only link is the id
            assert s.wait(timeout=600) == "completed", s.reason
            # the same run from its step-1 checkpoint, in a new run whose reward stops it once, at step 3
            f = s.fork(1, reward_funcs=[letters_stopping_once(root / "stopped")])
            assert f.wait(timeout=600) == "cancelled" and f.reason == "stopped on request", f.reason
            ilab("resume", f.run_id, check=0, env=env)       # from yet another process
            assert f.wait(timeout=600) == "completed", f.reason
            yield s, f
        finally: kill_processes_under(root / "runs")


@pytest.mark.processes
def test_a_run_from_a_kernel_that_exits_trains_on_two_ranks(grpo_run):
    "TRL's metric names, listed in the schema; the reward function saved by value with its source; KL to the start."
    from ilab_nb.rundir import schema_problems
    s, _ = grpo_run
    recs = [json.loads(l) for l in RunPaths(s.run_dir).metrics.read_text().splitlines()]
    assert [p for r in recs for p in schema_problems(r, r["kind"])] == []
    head = _records(s.run_dir, "header")[0]
    assert (head["method"], head["data_kind"], head["strategy"], head["world_size"]) == ("grpo", "prompt", "fsdp", 2)
    train = _records(s.run_dir, "train")
    assert [r["step"] for r in train] == [1, 2, 3, 4] and all(r["prompts"] == 2 for r in train)  # 1 prompt x 4 per rank
    for k in ("entropy", "kl", "clip_ratio/region_mean"):             # the loss's: at every step
        assert all(k in r and math.isfinite(r[k]) for r in train), k
    for k in ("reward", "reward_std", "rewards/letters/mean", "rewards/letters/std", "completions/mean_length",
              "completions/clipped_ratio", "frac_reward_zero_std"):   # a batch's: once, when sampled (as TRL logs)
        assert [r["step"] for r in train if k in r and math.isfinite(r[k])] == list(SAMPLED), k
    assert any(r.get("reward_std", 0) > 0 for r in train) and any(abs(r["loss"]) > 0 for r in train)
    assert train[1]["loss"] != train[0]["loss"]        # the same batch again, against the policy that sampled it
    kl = [r["kl"] for r in train]
    assert kl[0] == pytest.approx(0, abs=1e-7) and kl[-1] > 1e-6, kl   # the policy is the reference only at step 1
    p = RunPaths(s.run_dir)
    assert sorted(q.name for q in p.rewards.iterdir()) == ["0-letters.pkl", "0-letters.py"]
    assert "def letters" in (p.rewards / "0-letters.py").read_text()
    assert sorted(q.name for q in p.reference.iterdir()) == ["rank-0.pt", "rank-1.pt"]      # each rank its shard
    comp = {r["step"]: r["completions"] for r in _records(s.run_dir, "completions")}
    assert sorted(comp) == list(SAMPLED) and all(len(c) == 4 and set(c[0]["rewards"]) == {"letters"} for c in comp.values())
    # what the reward logged (TRL's log_metric, averaged over the ranks; log_extra, a column of rank 0's completions)
    assert [(r["step"], r["steps_done"], r["rank"]) for r in train if "rank" in r] == [(1, 0, 0.5), (3, 2, 0.5)], train
    evals = _records(s.run_dir, "eval")       # the held-out evaluations' calls: TRL's eval_<name>, the steps done
    assert [(r["step"], r["eval_steps_done"], r["eval_rank"]) for r in evals] == [(0, 0, 0.5), (3, 3, 0.5), (4, 4, 0.5)]
    assert all(c["extra"]["letter_count"] == sum(ch.isalpha() for ch in c["completion"]) for cs in comp.values() for c in cs)
    ev = _records(s.run_dir, "eval")                  # greedy answers to the held-out prompts, scored by `letters`
    assert [(r["step"], r["eval_prompts"]) for r in ev] == [(0, HELD_OUT), (3, HELD_OUT), (4, HELD_OUT)]
    assert all(math.isfinite(r[k]) for r in ev for k in ("eval_reward", "eval_rewards/letters/mean",
                                                         "eval_completions/mean_length"))
    assert ev[0]["eval_reward"] == ev[0]["eval_rewards/letters/mean"] and "eval_loss" not in ev[0]


@pytest.mark.processes
def test_stopped_and_resumed_from_a_new_kernel_it_samples_what_the_uninterrupted_run_did(grpo_run):
    """The fork from step 1, inside a generation batch (started from this process: the reward function comes from the
    saved file), trains step 2 on the batch its checkpoint kept, as the run did, and samples step 3 as the run did (the
    sampler's seed from the step); `stop()` at step 3, inside that batch, checkpoints it with the batch, and its
    `resume()` from another process trains step 4 on that same batch: the losses, rewards and held-out rewards of steps
    2-4 are the uninterrupted run's."""
    s, f = grpo_run
    events = [(r["attempt"], r["event"], r.get("step")) for r in _records(f.run_dir, "event")
              if r["event"] in ("stopped", "completed")]
    assert events == [(1, "stopped", 3), (2, "completed", 4)]
    assert [h["resumed_from_step"] for h in _records(f.run_dir, "header")] == [1, 3]
    comp = {r["step"]: r["completions"] for r in _records(s.run_dir, "completions")}
    again = {r["step"]: r["completions"] for r in _records(f.run_dir, "completions")}
    no_extra = lambda rows: [{k: v for k, v in c.items() if k != "extra"} for c in rows]   # the run's reward logs it
    assert sorted(again) == [3] and again[3] == no_extra(comp[3])  # steps 2 and 4 sampled nothing: the batch was kept
    train, fork_train = _records(s.run_dir, "train"), {r["step"]: r for r in _records(f.run_dir, "train")}
    assert sorted(fork_train) == [2, 3, 4]
    for r in train[1:]:
        assert ("reward" in fork_train[r["step"]]) == ("reward" in r), r["step"]
        for k in ("loss", "reward", "entropy", "kl", "clip_ratio/region_mean"):
            if k in r: assert fork_train[r["step"]][k] == pytest.approx(r[k], rel=1e-5, abs=1e-7), (r["step"], k)
    held, fork_held = ({r["step"]: r["eval_reward"] for r in _records(d, "eval")} for d in (s.run_dir, f.run_dir))
    assert sorted(fork_held) == [3, 4] and all(fork_held[k] == pytest.approx(held[k], abs=1e-7) for k in fork_held)


@pytest.mark.processes
def test_its_rewards_and_completions_are_watched(grpo_run, capsys):
    """The dashboard's reward plot (and beside it, what the reward function logged) and completions table, the record
    (report.html) with the reward's source, status, and the row a sweep compares it by."""
    import html
    from ilab_nb.cli import main
    from ilab_nb.sweep import run_summary
    s, _ = grpo_run
    rw = [r for r in _records(s.run_dir, "train") if "reward" in r][-1]     # step 3's: step 4 reused its batch
    last = {r["step"]: r["completions"] for r in _records(s.run_dir, "completions")}[3]
    dash = s.dashboard(autostart=False)
    dash.update()
    assert f"reward {rw['reward']:.3f}" in dash.progress_text.value and dash.reward_view.value[:4] == b"\x89PNG"
    panels = {a.get_title(loc="left"): {l.get_label() for l in a.lines} for a in dash._reward_fig.axes}
    assert panels["Logged metrics"] == {"steps_done", "rank", "held-out steps_done", "held-out rank"}
    held = _records(s.run_dir, "eval")[-1]["eval_reward"]
    assert f"held-out reward {held:.3f} (step 4)" in dash.progress_text.value
    assert "Completions at step 3" in dash.completions_view.value
    assert html.escape(last[0]["completion"]) in dash.completions_view.value
    shown_completions = dash.completions_view.value
    dash.close()
    s.report()
    report = RunPaths(s.run_dir).report.read_text()
    assert "Reward function" in report and html.escape("def letters(prompts, completions, trainer_state,") in report
    assert ">letter_count</th>" in report and ">letter_count</th>" in shown_completions     # log_extra's column
    assert "last held-out reward" in report
    assert main(["status", s.run_id, "--runs-root", str(Path(s.run_dir).parent)]) == 0
    out = capsys.readouterr().out
    assert f"reward {rw['reward']:.3f}  letters {rw['rewards/letters/mean']:.3f}" in out
    assert f"held-out reward {held:.3f}" in out
    row = run_summary(s.monitor)          # what a sweep's results() and report compare it by: its rewards
    assert (row["final_reward"], row["final_eval_reward"]) == (rw["reward"], held)


@pytest.mark.processes
def test_its_model_answers_in_a_chat_box_exports_and_is_evaluated_by_lm_eval(grpo_run, tmp_path):
    """The chat box over the GRPO run's final model answers; export() of that model writes every tensor (that a GGUF
    file reads back as the model is test_export's check); evaluate() with the run's own 'heldout' task, made from its
    held-out prompts and their 'answer' column, runs lm-eval on the trained model and keeps lm-eval's results and
    samples."""
    from ilab_nb.rundir import State
    s, _ = grpo_run
    box = s.chat(temperature=0.0, max_new_tokens=4)
    box.input.value = _prompts(1, offset=100)[0]["prompt"][-1]["content"]          # what Enter does
    assert box.wait(120) and box.error is None and "done" in box.status.value, box.status.value
    assert [m["role"] for m in box.chat.messages] == ["user", "assistant"]
    out = s.export(dtype="f32", path=tmp_path / "grpo.gguf", modelfile=False, progress=False)
    assert (out.name, out.tensors, out.fallbacks, out.exists()) == ("grpo.gguf", 38, {}, True)
    with pytest.MonkeyPatch.context() as mp:
        for k, v in runs_env(tmp_path).items(): mp.setenv(k, v)
        ev = s.evaluate(["heldout"], base=False)
        assert ev.wait(timeout=600) == State.completed, ev.reason
    df = ev.results().set_index("metric")
    (res,) = (ev.dir / "tuned").glob("results_*.json")
    got = json.loads(res.read_text())["results"]["heldout"]
    assert got["exact_match,none"] == df.loc["exact_match", "tuned"] and 0 <= got["exact_match,none"] <= 1
    samples = (ev.dir / "tuned").glob("samples_heldout_*.jsonl").__next__().read_text().splitlines()
    assert sorted(json.loads(l)["doc"]["target"] for l in samples) == sorted(r["answer"] for r in _prompts(HELD_OUT, 100))


# --- in this process: LoRA against its base, a reward that raises ---------------------------------------------------

def letters(prompts, completions, **kw):
    "Defined in this test file: the training processes cannot import it (it reaches them saved by value)."
    return [sum(ch.isalpha() for ch in c[0]["content"]) / 8 for c in completions]


def picky(prompts, completions, **kw):
    "Scores the preflight's dummy completions, and raises on a sampled one."
    text = [c[0]["content"] for c in completions]
    if any(t and "dummy" not in t for t in text): raise ValueError("cannot score this")
    return [0.0] * len(text)


def _in_process_run(demo, rd, data, **kw):
    "One process, in this one (the worker's `run`, no launch): the run's status."
    import torch.distributed as dist
    from ilab_nb import worker
    p = RunPaths(rd)
    p.logs.mkdir(parents=True)
    kw = {**GRPO_RUN, "model": str(demo.model_dir), "num_processes": 1, "strategy": "single", "max_steps": 2,
          "save_steps": None, "beta": 0.0, "eval_steps": None, "num_iterations": 1, **kw}
    G.save_rewards(TrainConfig(data=[str(data)], **kw), p).to_json(p.config)
    try: return worker.run(p)
    finally:
        if dist.is_available() and dist.is_initialized(): dist.destroy_process_group()


@pytest.mark.processes          # the reward functions' own process
def test_lora_against_its_base_and_a_reward_that_raises(demo, tmp_path, capsys):
    """beta > 0 with LoRA: the reference is the base with the adapters off (kl 0 at step 1, above 0 once the adapters
    moved, no starting shards kept). A reward function that raises fails the step, naming itself, the prompt and the
    traceback."""
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _prompts(4)))
    assert _in_process_run(demo, tmp_path / "lora", data, reward_funcs=[letters], beta=0.04, learning_rate=1e-2,
                           lora={"r": 4, "lora_alpha": 8}) == "completed"
    kl = [r["kl"] for r in _records(tmp_path / "lora", "train")]
    assert kl[0] == pytest.approx(0, abs=1e-7) and kl[-1] > 1e-6, kl
    assert not RunPaths(tmp_path / "lora").reference.exists()
    with pytest.raises(G.RewardError) as e:
        _in_process_run(demo, tmp_path / "c", data, reward_funcs=[picky], max_steps=1)
    msg = str(e.value)
    assert msg.startswith("reward function 'picky' raised ValueError: cannot score this at step 1, on prompt "
                          "[{'role': 'system'") and "\n" not in msg
    out = capsys.readouterr().out                                                   # its traceback: in the rank's log
    assert ", in picky\nValueError: cannot score this" in out, out[-2000:]
    failed = _records(tmp_path / "c", "event")[-1]
    assert failed["event"] == "failed" and "RewardError: reward function 'picky' raised ValueError: cannot score this at " \
        "step 1" in failed["error"]


@pytest.mark.processes
def test_a_completed_run_resumed_for_one_more_step_trains_on_the_batch_its_last_checkpoint_kept(demo, tmp_path):
    """num_iterations=2: a run that completes at step 3, the first step of its second generation batch, keeps that
    batch in its step-3 checkpoint; resumed with max_steps=4, its step 4 trains on that batch, sampling nothing, as the
    uninterrupted 4-step run's step 4 does: the same loss and KL to the last bit (one process, one thread, the same
    seed and a constant learning rate, so that steps 1-3 are the same in both)."""
    import torch.distributed as dist
    from ilab_nb import worker
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _prompts(4)))
    kw = dict(reward_funcs=[letters], num_iterations=2, beta=0.04, lr_scheduler_type="constant", save_steps=3)
    assert _in_process_run(demo, tmp_path / "whole", data, max_steps=4, **kw) == "completed"
    assert _in_process_run(demo, tmp_path / "part", data, max_steps=3, **kw) == "completed"
    p = RunPaths(tmp_path / "part")
    TrainConfig(**{**json.loads(p.config.read_text()), "max_steps": 4}).to_json(p.attempt_config(2))
    try: assert worker.run(p, resume=str(p.root / "checkpoints" / "step-00000003"), attempt=2) == "completed"
    finally:
        if dist.is_available() and dist.is_initialized(): dist.destroy_process_group()
    whole = {r["step"]: r for r in _records(tmp_path / "whole", "train")}
    part = {r["step"]: r for r in _records(p.root, "train")}
    assert sorted(part) == sorted(whole) == [1, 2, 3, 4]
    assert [(part[4][k], "reward" in part[4]) for k in ("loss", "kl")] == [(whole[4][k], False) for k in ("loss", "kl")]
    assert [r["step"] for r in _records(p.root, "completions")] == [1, 3]        # step 4 sampled nothing


@pytest.mark.processes
def test_a_sweep_over_reward_weights(demo, runs_root, tmp_path):
    """A sweep of two one-step GRPO runs, one process each, over `reward_weights`: the same seed samples the same
    completions from the same model, so each function's reward is the same and the weighted reward, the sweep table's
    `final_reward`, is exactly doubled."""
    from ilab_nb import FineTuneSession
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _prompts(4)))
    sw = FineTuneSession.sweep(str(demo.model_dir), str(data), grid={"reward_weights": [[1.0], [2.0]]},
                               **{**GRPO_RUN, "num_processes": 1, "strategy": "single", "max_steps": 1, "save_steps": None,
                                  "eval_steps": None, "beta": 0.0, "num_iterations": 1, "max_completion_length": 4},
                               reward_funcs=[letters])
    assert sw.wait(timeout=600) == ["completed", "completed"], [s.reason for s in sw.sessions]
    df = sw.results()
    assert list(df["reward_weights"]) == [[1.0], [2.0]] and list(df["step"]) == [1, 1]
    one, two = (s.metrics(kinds=("train",))[-1] for s in sw.sessions)
    assert one["rewards/letters/mean"] == two["rewards/letters/mean"] > 0         # the same completions
    assert list(df["final_reward"]) == [one["reward"], two["reward"]] and two["reward"] == 2 * one["reward"]


@pytest.mark.processes
def test_reward_functions_named_in_a_config_file(tmp_path):
    "A YAML config names its reward functions as a file's function and as 'module:function'; a missing file is refused."
    from ilab_nb.config import ConfigError
    (tmp_path / "rewards.py").write_text("def exact(prompts, completions, answer, **kw):\n    return [1.0] * len(completions)\n")
    base = "model: m\ndata: d.jsonl\nmethod: grpo\nnum_generations: 4\nper_device_train_batch_size: 4\n"
    (tmp_path / "c.yaml").write_text(base + f"reward_funcs: ['{tmp_path / 'rewards.py'}:exact', 'math:sqrt']\n")
    cfg = TrainConfig.from_file(tmp_path / "c.yaml")
    with UserCode(cfg.reward_funcs, timeout=60) as code: assert code.start() == ["exact", "sqrt"]   # as a rank loads them
    assert (cfg.beta, cfg.loss_type, cfg.batching) == (0.0, "dapo", "bucketed")            # TRL's GRPO defaults
    (tmp_path / "bad.yaml").write_text(base + "reward_funcs: ['nowhere.py']\n")
    with pytest.raises(ConfigError) as e: TrainConfig.from_file(tmp_path / "bad.yaml")
    assert "line 6" in str(e.value) and "nowhere.py: file not found" in str(e.value)


# --- it learns ------------------------------------------------------------------------------------------------------

def right_capital(prompts, completions, answer, **kw):
    "1.0 for exactly the right capital."
    return [float(c[0]["content"].strip().lower() == a.lower()) for c, a in zip(completions, answer)]


def one_word(prompts, completions, **kw):
    "The format reward: the demo's system prompt asks for a single word."
    return [float(len(c[0]["content"].split()) == 1) for c in completions]


def _capital_rows(file, n=None):
    "Every capital question of a shipped demo file, in its conversation so far, with its answer."
    rows = [{"prompt": c[:i], "answer": m["content"]} for c in read_chat_jsonl(shipped_data_dir() / file)
            for i, m in enumerate(c) if m["role"] == "assistant" and "capital" in c[i - 1]["content"].lower()]
    return rows[:n] if n else rows


def _expected_reward(model_dir, tok_dir, rows) -> float:
    """The mean over `rows` of the probability that a completion sampled at temperature 1 is exactly the right capital
    and then the end of the turn: the expected `right_capital` reward (up to other token spellings of the same text),
    computed exactly, with no sampling noise, in one padded forward."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tok_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    seqs = [(tok(tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False)["input_ids"], tok(r["answer"], add_special_tokens=False)["input_ids"]
             + [tok.eos_token_id]) for r in rows]
    width = max(len(p) + len(a) for p, a in seqs)
    ids = torch.tensor([p + a + [tok.pad_token_id] * (width - len(p) - len(a)) for p, a in seqs])
    mask = torch.tensor([[1] * (len(p) + len(a)) + [0] * (width - len(p) - len(a)) for p, a in seqs])
    with torch.no_grad(): lp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), -1)
    probs = [float(sum(lp[k, len(p) - 1 + t, x] for t, x in enumerate(a)).exp()) for k, (p, a) in enumerate(seqs)]
    return sum(probs) / len(probs)


# Measured on this machine (deterministic: seeded sampling, an exact expectation): 0.379 -> 0.437 after 30 steps of
# 4 prompts x 8 completions (20 steps gave 0.406; 8 steps 0.362 and 12 steps 0.383: the first steps' noise). A sampled
# estimate of the same quantity (152 questions x 8 samples, standard error ~0.014) agreed: 0.384 -> 0.450.
# The run's own held-out evaluation (eval_data: a greedy answer to each of the same 152 questions) does not show it: the
# greedy answers' reward went 0.783 -> 0.750 over these 30 steps (0.783 after 60; with learning_rate=1e-3, 0.092):
# the greedy answer was already right wherever the model's likeliest answer was; GRPO moved probability towards the
# right answers (the expected reward above), not the likeliest answer.
LEARNED_BEFORE, LEARNED_AFTER = 0.379, 0.437
LEARN = dict(max_steps=30, learning_rate=3e-4, lr_scheduler_type="constant", num_generations=8, num_iterations=1,
             per_device_train_batch_size=32, max_completion_length=6, max_seq_len=512, seed=0,
             num_completions_to_print=0)


@pytest.mark.processes
def test_grpo_raises_the_held_out_reward_of_a_partly_trained_demo_model(demo, demo_run, tmp_path):
    """The demo run's earliest kept checkpoint (partly SFT-trained), a few GRPO steps in this process on the training
    data's capital questions (right capital + one word): the expected reward on the 152 held-out capital questions
    rises."""
    from ilab_nb.rundir import complete_checkpoints
    start = complete_checkpoints(demo_run[1])[0]
    data = tmp_path / "capitals.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _capital_rows("train.jsonl")))
    held = _capital_rows("eval.jsonl")
    rd = tmp_path / "run"
    assert _in_process_run(demo, rd, data, model=str(start), reward_funcs=[right_capital, one_word], **LEARN) == "completed"
    before, after = _expected_reward(start, start, held), _expected_reward(rd / "final", start, held)
    train = _records(rd, "train")
    print(f"\n[measured] GRPO from {start.name} of the demo run, {LEARN['max_steps']} steps: held-out expected reward (right "
          f"capital, {len(held)} questions) {before:.4f} -> {after:.4f}; training reward {train[0]['reward']:.3f} "
          f"(step 1) -> {train[-1]['reward']:.3f}")
    rise = LEARNED_AFTER - LEARNED_BEFORE           # 0.058, measured: the rise asked is half of it (twice the margin)
    assert after - before >= rise / 2, (before, after)


# --- user code that misbehaves on 2 ranks: the run goes on as asked, or fails naming it ------------------------------

def misbehaving_on(counts: Path):
    """A reward function that misbehaves differently on each rank at each generation batch (its calls counted in
    `counts`, one file per rank, as its process may not survive): rank 0 ends its process with os._exit(0) at step 1,
    segfaults at step 2 and raises at step 3; rank 1 prints 5 MB at step 1, hangs at step 2 and calls sys.exit at
    step 3. Both score every completion 0.5 otherwise (the preflight's call, step 4)."""
    def misbehaving(prompts, completions, **kw):
        import ctypes, os, sys, time
        rank = os.environ.get("RANK")
        if rank is None: return [0.5] * len(completions)                     # the preflight, in the kernel's child
        f = counts / f"rank-{rank}"
        step = int(f.read_text()) + (len(completions) > 1) if f.exists() else 1     # one at a time: called again
        f.write_text(str(step))
        what = {("0", 1): lambda: os._exit(0), ("0", 2): lambda: ctypes.string_at(0),
                ("0", 3): lambda: 1 / 0, ("1", 1): lambda: print("x" * 1_000_000 + "\n") or print("y" * 4_000_000),
                ("1", 2): lambda: time.sleep(600), ("1", 3): lambda: sys.exit(1)}.get((rank, step))
        if what: what()
        return [0.5] * len(completions)
    return misbehaving


UNRULY = dict(method="grpo", num_processes=2, strategy="ddp", device="cpu", max_steps=4, logging_steps=1, save_steps=None,
              learning_rate=1e-3, num_generations=2, per_device_train_batch_size=2, max_completion_length=4, max_seq_len=256,
              num_iterations=1, beta=0.0, num_completions_to_print=0, seed=1, reward_timeout=2)


@pytest.mark.processes
def test_reward_functions_that_exit_crash_hang_or_raise_on_two_ranks_are_skipped_as_asked(demo, runs_root, tmp_path):
    """reward_errors='skip': every way user code can fail, on both ranks, in four steps; each failed call's rewards are
    left out (said in the rank's log and as the function's failure_frequency) and the run completes with its model,
    the other function's rewards counted throughout."""
    from ilab_nb import FineTuneSession
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _prompts(8)))
    (tmp_path / "counts").mkdir()
    s = FineTuneSession(str(demo.model_dir), str(data), reward_funcs=[misbehaving_on(tmp_path / "counts"), letters],
                        reward_errors="skip", **UNRULY).start()
    assert s.wait(timeout=600) == "completed", s.reason
    train = s.metrics(kinds=("train",))
    assert [r["rewards/misbehaving/failure_frequency"] for r in train] == [0.5, 1.0, 1.0, 0.0]
    assert all(math.isfinite(r["rewards/letters/mean"]) for r in train)
    assert [r["rewards/misbehaving/mean"] for r in train][-1] == 0.5 and math.isnan(train[1]["rewards/misbehaving/mean"])
    logs = {r: RunPaths(s.run_dir).rank_log(r).read_text() for r in (0, 1)}
    said = lambda r, what, step: any(what in l and f"at step {step}" in l for l in logs[r].splitlines())
    assert said(0, "ended its process while it ran (it exited with code 0, as os._exit(0) does)", 1)
    assert said(0, "ended its process while it ran (it was killed by SIGSEGV)", 2)
    assert said(0, "'misbehaving' raised", 3) and "ZeroDivisionError" in logs[0]
    assert said(1, "did not return within 2 s (it was stopped)", 2)
    assert said(1, "'misbehaving' raised", 3) and "SystemExit: 1" in logs[1]
    assert len(logs[1]) > 5_000_000 and logs[0].count("left out (reward_errors='skip')") == 3
    assert (RunPaths(s.run_dir).final / "config.json").exists()


@pytest.mark.processes
def test_a_reward_function_that_hangs_on_one_of_two_ranks_fails_the_run_naming_it(demo, runs_root, tmp_path):
    """reward_errors='fail' (the default): rank 1's call hangs at step 2; it is stopped after reward_timeout and both
    ranks end, the run `failed` with the function, the step and the rank, no model."""
    from ilab_nb import FineTuneSession
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _prompts(8)))
    (tmp_path / "counts").mkdir()
    (tmp_path / "counts" / "rank-0").write_text("3")                        # rank 0 scores its batch
    (tmp_path / "counts" / "rank-1").write_text("1")                        # rank 1's next batch is its step 2: a hang
    s = FineTuneSession(str(demo.model_dir), str(data), reward_funcs=[misbehaving_on(tmp_path / "counts")],
                        **{**UNRULY, "max_steps": 2}).start()
    assert s.wait(timeout=600) == "failed"
    assert s.reason.startswith(f"Run {s.run_id} failed: rank 1 ") and "RewardError: reward function 'misbehaving' did " \
           "not return within 2 s (it was stopped) at step 1; give it more time with reward_timeout" in s.reason, s.reason
    assert not RunPaths(s.run_dir).final.exists()
