"""GRPO with tools against TRL's own `GRPOTrainer` (issue 52, proof (a)): the same scripted multi-turn episodes (the
model's turns fixed, its tools and environments real) assembled by TRL's tool-calling loop and by ilab_nb's
(`GRPO.episodes` -> `agents.run_episodes` over a real user-code child), then scored and trained on by both, per
loss_type: the prompt and completion ids, the tool masks, the episodes, the rewards, the advantages, the loss and every
metric agree."""
import json, math
from contextlib import contextmanager, nullcontext
from types import SimpleNamespace as NS

import pytest
import torch

trl = pytest.importorskip("trl")
import platform
platform.processor()      # runs `uname -p` once per process (GRPOTrainer asks for it): at import, not inside a test

from ilab_nb import grpo as G
from ilab_nb.config import TrainConfig
from ilab_nb.rundir import RunPaths

from conftest import within
from test_agents import Vault, agent_model, open_vault

# it starts a user-code child; its four cases share one (`ours`), so under `make test` they run on one worker
pytestmark = [pytest.mark.processes, pytest.mark.timeout(300), pytest.mark.xdist_group("agents_trl")]


def read_manual(page: int) -> str:
    """Read a page of the vault's manual.

    Args:
        page: the page to read
    """
    if page < 1: raise ValueError(f"there is no page {page}")
    return "Turn the dial. " * (1 if page == 1 else 40)


class Lock:
    "An environment: a lock whose code is its row's; reset says how many digits it has; reward: opened, less tries."
    def reset(self, code, **row):
        self.code, self.tries, self.opened = code, 0, False
        return f" Its code has {len(str(code))} digit."

    def unlock(self, code: int) -> str:
        """Try a code on the lock.

        Args:
            code: the code to try
        """
        self.tries += 1
        if code != self.code: raise ValueError(f"wrong code {code}")
        self.opened = True
        return "Unlocked."

    def get_reward(self) -> float:
        return float(self.opened) - 0.25 * self.tries


def finished(completions, environment, **kw):
    "An episode's reward: 1 when its last turn says 'Done.', less 0.1 per message (turns and tool results)."
    return [float(c[-1]["content"] == "Done.") - 0.1 * len(c) for c in completions]


NUM_GEN, COMP_LEN, ROUNDS, POSITIONS = 4, 360, 3, 2048
ROWS = [{"prompt": [{"role": "user", "content": "Open the amber vault."}], "environment": "vault", "code": 0},
        {"prompt": [{"role": "user", "content": "Open the lock."}], "environment": "lock", "code": 5}]
# "safe", the vault under a second name, which no row uses: still one reward column per class (TRL's)
ENVS = {"vault": Vault, "lock": Lock, "safe": Vault}
EOS = "<|im_end|>"
DONE = "Done." + EOS


def call(*calls) -> str:
    "A turn of tool calls as Qwen2.5 writes them."
    return "\n".join(f'<tool_call>\n{json.dumps({"name": n, "arguments": a})}\n</tool_call>' for n, a in calls) + EOS


# The model's turns, rollout by rollout (2 prompts x 4): rollouts 0-3 open the vault (tools open_vault, read_manual and
# the vault's own open_vault), rollouts 4-7 the lock (open_vault, read_manual and the lock's unlock).
TURNS = [
    [call(("open_vault", {})), DONE],            # calls the vault's own open_vault, not the tool of its name (as TRL)
    [DONE],                                                                             # answers at once
    # two calls in one turn, one of them to an unknown tool; then a tool that raises
    [call(("open_vault", {}), ("nope", {})), call(("read_manual", {"page": 0})), DONE],
    ['<tool_call>\n{"name": "open_vault", "argu\n</tool_call>' + EOS],                 # a malformed call: text
    [call(("unlock", {"code": 3})), call(("unlock", {"code": 5})), DONE],               # a wrong code, the right one
    # page 2's result would take it past max_completion_length: rolled back, the rollout ends with its call
    [call(("read_manual", {"page": 1})), call(("read_manual", {"page": 2})), DONE],
    [call(("unlock", {"code": 5, "force": True})), "Turn the dial. " * 100],    # bad arguments; a turn cut at the end
    [call(("unlock", {"code": c})) for c in (1, 2, 4, 5)],            # max_tool_calling_iterations: its 4th call unrun
]
ASKED = [2, 1, 3, 1, 3, 2, 2, 4]          # the turns each rollout is asked for: the last of rollout 5 never is
CALLS, FAILURES = 12, 7


class Script:
    """The model's turns, scripted: rollout j's k-th turn the k-th time it is asked to go on. The first batch is the
    prompts (the j-th is rollout j); later, rollout j is the one whose prompt and first turn the ids begin with."""
    def __init__(self, tok):
        self.turns = [[tok(t, add_special_tokens=False)["input_ids"] for t in ts] for ts in TURNS]
        self.prompts, self.asked = None, [0] * len(TURNS)

    def next(self, j: int) -> list:
        assert self.asked[j] < len(self.turns[j]), f"rollout {j} asked for a turn after its {len(self.turns[j])}"
        self.asked[j] += 1
        return list(self.turns[j][self.asked[j] - 1])

    def rollout(self, ids: list) -> int:
        found = [j for j, (p, t) in enumerate(zip(self.prompts, self.turns)) if ids[:len(p) + len(t[0])] == p + t[0]]
        assert len(found) == 1, found
        return found[0]

    def batch(self, prompt_ids: list) -> list:
        if self.prompts is None:
            self.prompts = [list(p) for p in prompt_ids]
            return [self.next(j) for j in range(len(prompt_ids))]
        return [self.next(self.rollout(list(ids))) for ids in prompt_ids]


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    "test_agents' tiny model, with room for the tools' schemas (about 1,000 tokens of its prompts) and the episodes."
    from transformers import AutoModelForCausalLM
    path = tmp_path_factory.mktemp("agent") / "model"
    tok, _ = agent_model(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config.max_position_embeddings = POSITIONS
    model.save_pretrained(path)
    tok.model_max_length = POSITIONS
    tok.save_pretrained(path)
    return path


def _trl_side(path, tmp_path, kw):
    "TRL's GRPOTrainer on the model, its sampler replaced by the script: its generation batch, the trainer, the script."
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    script = Script(tok)

    class Scripted(trl.GRPOTrainer):
        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
            return [t[:COMP_LEN] for t in script.batch(prompt_ids)], None     # max_new_tokens=max_completion_length

    args = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), num_generations=NUM_GEN, report_to=[], use_cpu=True,
                          per_device_train_batch_size=2 * NUM_GEN, max_completion_length=COMP_LEN, bf16=False,
                          max_tool_calling_iterations=ROUNDS, reward_weights=[0.5], **kw)
    tr = Scripted(model=AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), reward_funcs=[finished],
                  args=args, processing_class=tok, train_dataset=datasets.Dataset.from_list(ROWS),
                  tools=[open_vault, read_manual], environment_factory=ENVS)
    tr.model.train()
    tr.current_gradient_accumulation_steps = 1
    out = tr._generate_and_score_completions([dict(r) for r in ROWS for _ in range(NUM_GEN)])
    return out, tr, script


BASE = dict(beta=0.0, epsilon=0.2, epsilon_high=None, scale_rewards="group", mask_truncated_completions=False)
CASES = [dict(loss_type="dapo", beta=0.04, scale_rewards="batch", epsilon_high=0.28), dict(loss_type="dr_grpo"),
         dict(loss_type="bnpo", num_iterations=2),
         dict(loss_type="grpo", scale_rewards="none", mask_truncated_completions=True)]


@pytest.fixture(scope="module")
def ours(agent, tmp_path_factory):
    """ilab_nb's GRPO on the same model, prepared once (its user-code child's start is most of a case's time), with
    beta > 0 so that it keeps the starting weights for the case that needs them: a case changes only what `prepare`
    does not read (`cfg` below). Yields `run(case)`: that case's one micro-batch, the method, the script and what was
    written, its sampler replaced by a fresh script."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(agent)
    pad = tok.pad_token_id
    model = AutoModelForCausalLM.from_pretrained(agent, dtype=torch.float32).train()
    def cfg(kw): return TrainConfig(
        model=str(agent), data=["x.jsonl"], method="grpo", reward_funcs=[finished], tools=[open_vault, read_manual],
        environment_factory=ENVS, num_generations=NUM_GEN, max_completion_length=COMP_LEN,
        per_device_train_batch_size=2 * NUM_GEN, max_seq_len=POSITIONS, max_tokens_per_batch=8 * POSITIONS,
        num_processes=1, tool_timeout=10, max_tool_calling_iterations=ROUNDS, reward_weights=[0.5],
        num_completions_to_print=2 * NUM_GEN, **kw)
    env = NS(device=torch.device("cpu"), device_type="cpu", rank=0, world_size=1)
    written = []
    att = NS(paths=RunPaths(tmp_path_factory.mktemp("ilab") / "run"), env=env, model=model, resumed=False,
             tokenizer=tok, start=0, autocast=nullcontext, metrics=NS(write=lambda kind, **kw: written.append(kw)),
             forward=lambda batch, fn: G.model_forward(model, batch, env, nullcontext, fn))
    att.paths.root.mkdir()
    recs = [{"kind": "prompt", "prompt": r["prompt"], "columns": {k: r[k] for k in ("environment", "code")},
             "source": f"d.jsonl:{i}"} for i, r in enumerate(ROWS)]
    g = G.GRPO(cfg({**BASE, "beta": 0.04}))
    g.tokenizer = tok
    ds, _ = G.build_prompts(recs, tok, POSITIONS - COMP_LEN)
    g.prepare(att, None)

    def run(kw):
        script = Script(tok)

        @contextmanager
        def generating(model, env, autocast, step, greedy=False):
            "GRPO.generating's `gen` as `generate` answers: each row's turn up to max_new tokens, padded after its end."
            def gen(x, xm, max_new):
                if x is None: return None
                ids = [[t for t, m in zip(r, rm) if m] for r, rm in zip(x.tolist(), xm.tolist())]
                turns = [t[:max_new] for t in script.batch(ids)]
                width = max(map(len, turns))
                return torch.tensor([t + [pad] * (width - len(t)) for t in turns])
            yield gen

        g.cfg, g.buffer, g.generating = cfg(kw), None, generating
        batches = g.micro_batches(ds, [[[0, 1]]], 0, "bucketed", pad)
        assert len(batches) == 1
        return batches[0], g, script, written[-1]["completions"]
    try: yield run
    finally: g.close()


# Tolerances, from the largest differences measured by this test over the four cases (trl 1.16, transformers 5.25,
# torch 2.13 CPU, float32, on the 2-core build machine); the ids, masks, episodes, rewards, advantages and tool metrics
# are equal (the same operations on the same values). Loss 1.5e-8 relative (grpo: one float32 ulp; dapo, dr_grpo and
# bnpo 0); metrics 4.5e-7 absolute (grpo's entropy: TRL's fused output layer, `fused_lm_head`, against the full logits;
# 2.1e-7 in the other cases); the reference's and the old log-probabilities 9.5e-7 absolute (the same cause: one or two
# float32 ulps of values near -6). Each tolerance is about 3x the difference measured, never within issue 37's 2x.
SEEN = "trl 1.16 / torch 2.13 CPU fp32, tools: loss 1.5e-8 rel., metrics 4.5e-7 abs., reference/old log-probs 9.5e-7"
LOSS_TOL, METRIC_TOL, LOGP_TOL = 5e-8, 1.5e-6, 3e-6


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_grpo_with_tools_agrees_with_trl(agent, ours, tmp_path, case):
    """The same scripted episodes of two environments (every way a tool call goes: one per turn and two in a turn, an
    environment's method and a standalone tool of the same name, an unknown tool, a tool that raises, bad arguments, a
    malformed call, a result that would overflow max_completion_length and is rolled back, a turn cut at it,
    max_tool_calling_iterations reached) through TRL's GRPOTrainer and ilab_nb's GRPO: the same ids, masks, episodes,
    reward columns, rewards and advantages; the loss and every metric within tolerance, with the old log-probabilities
    shifted so that clipping happens (the reference's too)."""
    name, kw = case["loss_type"], BASE | case
    out, tr, trl_script = _trl_side(agent, tmp_path, kw)
    b, g, our_script, rows = ours(kw)

    # the episodes: the same turns asked for, the same token ids and masks, the same messages and rewards
    assert trl_script.asked == our_script.asked == ASKED
    assert g.names == tr.reward_func_names == ["finished", "Vault", "Lock"]
    for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "tool_mask"):
        assert torch.equal(b[k].long(), out[k].long()), k
    assert int(b["num_items_in_batch"]) == int(out["num_items_in_batch"])
    episodes = [r["episode"] for r in rows]
    assert episodes == list(tr._logs["completion"])[-2 * NUM_GEN:]
    assert [len(e) for e in episodes] == [3, 1, 6, 1, 5, 3, 3, 7]
    assert episodes[5][-1]["tool_calls"] and episodes[7][-1]["tool_calls"]   # rolled back; out of rounds
    assert "tool_calls" not in episodes[3][0] and episodes[3][0]["content"].startswith("<tool_call>")   # text
    for k, r in enumerate(rows):
        theirs = {n: list(tr._logs["rewards"][n])[-2 * NUM_GEN + k] for n in tr.reward_func_names}
        assert r["rewards"] == {n: None if math.isnan(v) else v for n, v in theirs.items()}, k
    assert rows[0]["rewards"]["Vault"] == 1.0                              # the vault's own open_vault was called
    assert torch.equal(b["advantages"], out["advantages"])
    pad, eos = g.tokenizer.pad_token_id, g.tokenizer.eos_token_id
    ends = [int(row[row != pad][-1]) for row in out["completion_ids"]]
    assert [k for k, e in enumerate(ends) if e != eos] == [6]            # only rollout 6 is cut (truncated)

    mask = (b["completion_mask"] * b["tool_mask"]).bool()
    if kw["beta"]:
        within(f"GRPO tools {name}: reference log-probabilities, max |ilab_nb - TRL|",
               ((b["ref_logps"] - out["ref_per_token_logps"]) * mask).abs().max(), LOGP_TOL, SEEN)
    if kw.get("num_iterations", 1) > 1:
        within(f"GRPO tools {name}: old log-probabilities, max |ilab_nb - TRL|",
               ((b["old_logps"] - out["old_per_token_logps"]) * mask).abs().max(), LOGP_TOL, SEEN)
    # the loss, on old (and reference) log-probabilities shifted from the model's so that clipping happens
    with torch.no_grad():
        lp, _, _ = tr._get_per_token_logps_and_entropies(
            tr.model, torch.cat([out["prompt_ids"], out["completion_ids"]], 1),
            torch.cat([out["prompt_mask"], out["completion_mask"]], 1), out["completion_ids"].shape[1])
    shift = torch.linspace(-0.4, 0.4, lp.numel()).view_as(lp)
    out["old_per_token_logps"] = b["old_logps"] = lp + shift
    if kw["beta"]: out["ref_per_token_logps"] = b["ref_logps"] = lp - shift.flip(0)
    theirs_loss = float(tr._compute_loss(tr.model, out).detach())
    theirs = {k: v[-1] for k, v in tr._metrics["train"].items()}
    loss, sums = g.loss_sums(g.attempt.forward, b)
    mine = g.record(float(loss.detach()), b["scale"], {k: float(v) for k, v in sums.items()})
    within(f"GRPO tools {name}: loss, |ilab_nb - TRL| / max(1, |TRL|)",
           abs(mine["loss"] - theirs_loss) / max(1.0, abs(theirs_loss)), LOSS_TOL, SEEN)

    names = set(theirs) - {"num_tokens"}
    assert names <= set(mine), names - set(mine)
    assert {k for k in names if math.isnan(theirs[k])} == {k for k in names if math.isnan(mine[k])}
    assert mine["tools/call_frequency"] == CALLS / (2 * NUM_GEN) == theirs["tools/call_frequency"]
    assert mine["tools/failure_frequency"] == FAILURES / CALLS
    assert theirs["tools/failure_frequency"] == float(torch.tensor(FAILURES / CALLS))    # TRL divides float32 tensors
    # the completions' lengths: the model's tokens (tool_mask 1) only, as TRL counts them
    stats = [k for k in names if k.startswith("completions/")]
    assert len(stats) == 7 and {k: theirs[k] for k in stats} == {k: mine[k] for k in stats}
    if not kw["mask_truncated_completions"]:
        lengths = (out["completion_mask"] * out["tool_mask"]).sum(1)
        truncated = torch.tensor([k == 6 for k in range(2 * NUM_GEN)])
        assert G.completion_stats(lengths, truncated) == {k: theirs[k] for k in stats}
    diffs = {k: abs(mine[k] - theirs[k]) for k in names if not math.isnan(theirs[k])}
    worst = max(diffs, key=diffs.get)
    within(f"GRPO tools {name}: {len(names)} metrics (largest: {worst}), max |ilab_nb - TRL|", diffs[worst],
           METRIC_TOL, SEEN)
    assert 0 < theirs["clip_ratio/region_mean"] < 1       # the shifted old log-probabilities clip some tokens
