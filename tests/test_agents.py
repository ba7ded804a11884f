"""GRPO with tools and environments (issue 52's foundation), in this process and the user-code child it starts: the
chat template check (TRL's response templates), every way a tool can fail (raise, hang past tool_timeout, sys.exit,
os._exit, a segfault) as a failed call whose result the model reads while the caller goes on, an environment's state
made again after its process was lost, its get_reward as a reward column, a GRPO generation batch of episodes on a
tiny model with TRL's Qwen2.5 chat template (tools/ metrics, tool_mask out of the loss), and the preflight naming a
tool without a docstring."""
import json, math
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch

from ilab_nb import agents as A
from ilab_nb.usercode import UserCode

trl = pytest.importorskip("trl")
pytestmark = [pytest.mark.processes, pytest.mark.timeout(300)]


def open_vault() -> str:
    """Open the vault the user names."""
    return "The vault is open."


def broken(how: str) -> str:
    """A tool that fails.

    Args:
        how: raise, hang, exit, leave or crash
    """
    import ctypes, os, sys, time
    if how == "raise": raise ValueError("no vault here")
    if how == "hang": time.sleep(60)
    if how == "exit": sys.exit(3)
    if how == "leave": os._exit(0)
    if how == "crash": ctypes.string_at(0)
    return "fine"


def nodoc(x: int) -> int:
    return x


class Vault:
    "An environment whose reward is whether its tool was called."
    def reset(self, **row):
        self.opened = False
        return None

    def open_vault(self) -> str:
        """Open the vault the user names."""
        self.opened = True
        return "The vault is open."

    def get_reward(self) -> float:
        return float(self.opened)


def agent_model(path: Path):
    "A tiny random Llama whose tokenizer has TRL's Qwen2.5 chat template and its tool-call tokens."
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in special])
    tok.add_tokens([AddedToken(t, special=False) for t in ("<tool_call>", "</tool_call>", "<tool_response>",
                                                           "</tool_response>")])
    text = [template, "Open the amber vault. The vault is open. Done.", '{"name": "open_vault", "arguments": {}}']
    tok.train_from_iterator(text, trainer=trainers.BpeTrainer(vocab_size=300, special_tokens=special,
                                                              show_progress=False,
                                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        chat_template=template, model_max_length=1024)
    ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
                                         max_position_embeddings=512, **ids))
    tokenizer.save_pretrained(path)
    model.save_pretrained(path)
    return tokenizer, model


def test_the_chat_template_must_parse_tool_calls(tmp_path, demo):
    tok, _ = agent_model(tmp_path / "agent")
    assert A.tool_chat(tok) is None                       # TRL knows Qwen2.5's template; it is prefix-preserving
    assert tok.response_template is not None
    from ilab_nb.data import load_tokenizer
    with pytest.raises(A.ToolError, match="not one whose tool calls trl can parse.*response_template"):
        A.tool_chat(load_tokenizer(str(demo.model_dir)))
    calls = [{"type": "function", "function": {"name": "open_vault", "arguments": {}}}]
    suffix = A.tool_suffix_ids(tok, [{"role": "tool", "name": "open_vault", "content": "ok"}])
    assert tok.decode(suffix).startswith("\n<|im_start|>user\n<tool_response>\nok\n</tool_response>")
    assert tok.decode(suffix).endswith("<|im_start|>assistant\n")
    assert calls                                           # (the dummy call the suffix is found with)


def test_every_failing_tool_is_a_failed_call_and_the_caller_goes_on():
    code = UserCode([broken, Vault], 30, ["tool", "environment"], [1, 1])
    with code:
        code.start()
        box = A.Toolbox(code, [0], {None: 1}, 1)
        assert box.describe() == []
        assert [s["function"]["name"] for s in box.tools_for(None)] == ["broken", "open_vault"]
        assert box.reset([None, None], [{"prompt": "p"}, {"prompt": "q"}]) == [None, None]
        def call(j, name, **args):
            return box.call(j, {"type": "function", "function": {"name": name, "arguments": args}})
        assert call(0, "open_vault") == ("open_vault", "The vault is open.", False)   # rollout 0's environment
        assert box.env_rewards() == {"Vault": [1.0, 0.0]}
        assert call(0, "broken", how="raise") == ("broken", {"error": "no vault here"}, True)    # TRL's str(e)
        name, result, failed = call(0, "broken", how="hang")
        assert failed and result == {"error": "timed out after 1 s"}
        for how, said in (("exit", "3"), ("leave", "exited with code 0"), ("crash", "SIGSEGV")):
            name, result, failed = call(1, "broken", how=how)
            assert failed and said in result["error"], (how, result)
        assert call(1, "nope") == ("nope", {"error": "Tool nope not found."}, True)
        assert (box.calls, box.failures) == (7, 6)
        assert call(0, "broken", how="fine")[1] == "fine"                         # a fresh child answers
        # the environments died with their child: made and reset again from their rows, their state lost
        assert box.env_rewards() == {"Vault": [0.0, 0.0]}
    assert code.proc is None


def test_an_environment_reward_and_a_tool_without_docstring(tmp_path):
    code = UserCode([nodoc, Vault], 30, ["tool", "environment"], [5, 5])
    with code:
        code.start()
        box = A.Toolbox(code, [0], {None: 1}, 5)
        problems = box.describe()
        assert problems == ["tool 'nodoc': Cannot generate JSON schema for nodoc because it has no docstring!"]
        box.reset([None, None], [{}, {}])
        box.call(1, {"type": "function", "function": {"name": "open_vault", "arguments": {}}})
        assert box.env_rewards() == {"Vault": [0.0, 1.0]}


def test_a_generation_batch_of_episodes(tmp_path):
    from ilab_nb.config import TrainConfig
    from ilab_nb.grpo import GRPO, build_prompts, policy_loss
    from ilab_nb.rundir import RunPaths
    tok, model = agent_model(tmp_path / "agent")

    def done(completions, environments, **kw):
        return [float(c[-1]["content"].strip() == "Done.") + 0.0 * len(environments) for c in completions]

    cfg = TrainConfig(model=str(tmp_path / "agent"), data=["x.jsonl"], method="grpo", reward_funcs=[done],
                      environment_factory=Vault, tools=[open_vault], num_generations=4, per_device_train_batch_size=8,
                      max_completion_length=24, max_seq_len=400, max_tokens_per_batch=4096, num_processes=1,
                      tool_timeout=5, max_tool_calling_iterations=2)
    recs = [{"kind": "prompt", "prompt": [{"role": "user", "content": f"Open the {n} vault."}], "columns": {},
             "source": f"d.jsonl:{i}"} for i, n in enumerate(["amber", "birch"])]
    written = []
    env = NS(device=torch.device("cpu"), device_type="cpu", rank=0, world_size=1)
    att = NS(paths=RunPaths(tmp_path / "run"), env=env, model=model, resumed=False, tokenizer=tok, start=0,
             autocast=nullcontext, metrics=NS(write=lambda kind, **kw: written.append((kind, kw))))
    g = GRPO(cfg)
    g.tokenizer = tok
    ds, _ = build_prompts(recs, tok, 370)
    g.prepare(att, None)
    try:
        assert g.names == ["done", "Vault"]
        batches = g.micro_batches(ds, [[[0, 1]]], 0, "bucketed", tok.pad_token_id)
        b = batches[0]
        m = b["metrics"]
        assert {"tools/call_frequency", "tools/failure_frequency", "rewards/Vault/mean", "rewards/done/mean"} <= set(m)
        assert b["tool_mask"].shape == b["completion_ids"].shape
        kind, rec = written[-1]
        assert kind == "completions" and all("episode" in r for r in rec["completions"])
        # a tool result's tokens bear no loss: the loss is the one over completion_mask x tool_mask
        b["tool_mask"][:, 1:3] = 0
        lp = torch.randn(b["completion_ids"].shape)
        loss, _ = g.loss_sums(lambda batch, fn: (lp, torch.zeros_like(lp)), b)
        want, _ = policy_loss(lp, lp, b["advantages"], b["completion_mask"] * b["tool_mask"], cfg, None,
                              torch.zeros_like(lp), b["num_items_in_batch"], b["accumulation"], env)
        assert torch.allclose(loss, want * b["scale"])
    finally:
        g.close()


# --- real runs: 2 ranks, a kernel that exits, unequal rounds, failing tools, a fork on the same episodes, learning ---

KERNEL = '''
import json, os, sys, time, ctypes
from pathlib import Path
from ilab_nb import FineTuneSession

class RankVault:
    """The agent demo's vault, told to knock three times on rank 0 and to wait on rank 1: one rank's rollouts run
    three rounds of tool calls, the other's none. With ILAB_TEST_FAULTS set, a second knock hangs, then one ends its
    process with os._exit(0), then one segfaults, each once in the run (a failure loses the process's environments: the
    next second knock comes a round later, so the three fall in step 1's rounds 2 to 4), and the first knock prints
    megabytes. Each call is noted per rank."""
    def reset(self, vault=None, **row):
        self.opened, self.knocks = False, 0
        return " Knock." if os.environ.get("RANK") == "0" else " Wait."

    def knock(self) -> str:
        """Knock on the vault's door."""
        self.knocks += 1
        print(f"knock {self.knocks} on rank {os.environ['RANK']}", flush=True)      # into the rank's log
        with open(Path(os.environ["ILAB_NB_RUN_DIR"]) / f"calls-rank{os.environ['RANK']}", "a") as f: f.write("k")
        loud = Path(os.environ["ILAB_NB_RUN_DIR"]) / "loud"
        if os.environ.get("ILAB_TEST_FAULTS") and not loud.exists():   # once: megabytes on stdout and stderr
            loud.touch()
            print("o" * 2_000_000, flush=True); print("e" * 2_000_000, file=sys.stderr, flush=True)
        if os.environ.get("ILAB_TEST_FAULTS") and self.knocks == 2:
            for fault in ("hang", "leave", "crash"):
                done = Path(os.environ["ILAB_NB_RUN_DIR"]) / f"fault-{fault}"
                if not done.exists():
                    done.touch()
                    if fault == "hang": time.sleep(60)
                    if fault == "leave": os._exit(0)
                    ctypes.string_at(0)
        return "The door is open." if self.knocks >= 3 else "Knock again."

    def open_vault(self) -> str:
        """Open the vault the user names."""
        self.opened = True
        return "The vault is open."

def knocked(completions, environments, **kw):
    "1.0 for an episode that knocked three times and got in (defined in this kernel: saved by value)."
    return [float(sum(m["role"] == "tool" and m["content"] == "The door is open." for m in c) == 1)
            for c in completions]

os.environ["ILAB_TEST_FAULTS"] = "1"          # the run's processes inherit it; a fork started elsewhere does not
s = FineTuneSession(model=sys.argv[1], data=sys.argv[2], reward_funcs=[knocked], environment_factory=RankVault,
                    **json.loads(sys.argv[3]))
s.start()
print(s.run_id)
'''

AGENT_RUN = dict(method="grpo", num_processes=2, strategy="fsdp", device="cpu", max_steps=2, save_steps=1,
                 logging_steps=1, learning_rate=1e-3, num_generations=4, per_device_train_batch_size=4,
                 max_completion_length=128, max_seq_len=256, max_tokens_per_batch=2048, seed=1,
                 max_tool_calling_iterations=4, tool_timeout=2, num_completions_to_print=4)


def _records(rd, kind):
    from ilab_nb.rundir import RunPaths
    return [r for r in map(json.loads, RunPaths(rd).metrics.read_text().splitlines()) if r["kind"] == kind]


@pytest.fixture(scope="module")
def agent():
    from ilab_nb.agent_demo import agent_assets
    return agent_assets()          # built once per machine (~/.cache/ilab_nb/agent), as the demo's assets are


@pytest.fixture(scope="module")
def agent_run(agent, tmp_path_factory):
    """A 2-rank FSDP GRPO run with an environment of the kernel's `__main__` (the kernel exits at once), rank 0's
    rollouts knocking three rounds and rank 1's none, a hang, an os._exit, a segfault and a sys.exit among rank 0's
    calls; then a fork sweep (one run) from its step 1, from this process, without the faults."""
    import subprocess, sys
    from ilab_nb import FineTuneSession
    from conftest import cli_env, kill_processes_under, runs_env
    root = tmp_path_factory.mktemp("agents")
    env = cli_env(**runs_env(root))
    with pytest.MonkeyPatch.context() as mp:
        for k, v in runs_env(root).items(): mp.setenv(k, v)
        try:
            (root / "kernel.py").write_text(KERNEL)
            k = subprocess.run([sys.executable, str(root / "kernel.py"), str(agent.model_dir), str(agent.train_file),
                                json.dumps(AGENT_RUN)], capture_output=True, text=True, timeout=300, env=env)
            assert k.returncode == 0, k.stderr[-3000:]
            s = FineTuneSession.attach(k.stdout.split()[-1])
            assert s.wait(timeout=600) == "completed", s.reason
            # a fork sweep (of one run: each costs a 2-rank start) over another tools' setting, which step 2 (no call
            # fails) never uses, and a tracker, which shows the episodes as text
            sw = s.fork_sweep(1, tool_timeout=[5], report_to=["tensorboard"])
            assert [f.wait(timeout=600) for f in sw.sessions] == ["completed"], [f.reason for f in sw.sessions]
            yield s, sw
        finally: kill_processes_under(root / "runs")


def test_unequal_rounds_and_failing_tools_leave_two_ranks_training(agent_run):
    """Rank 0's rollouts call the tool three rounds, rank 1's none, and neither waits for the other (the run ends);
    the hang (past tool_timeout), the os._exit and the segfault were failed calls, counted and shown to the model as
    errors; a tool's megabytes of output went to the rank's log; the episodes are in the completions records; the
    environment and reward are saved by value."""
    from ilab_nb.rundir import RunPaths
    s, _ = agent_run
    d = Path(s.run_dir)
    assert sorted(p.name for p in d.glob("fault-*")) == ["fault-crash", "fault-hang", "fault-leave"]   # once each
    assert not (d / "calls-rank1").exists() and len((d / "calls-rank0").read_text()) >= 4 * 3 + 4   # rank 1: none
    train = _records(s.run_dir, "train")
    assert [r["step"] for r in train] == [1, 2]
    assert train[0]["tools/failure_frequency"] > 0 and train[1]["tools/failure_frequency"] == 0
    assert all(r["tools/call_frequency"] >= 1.0 for r in train), [r["tools/call_frequency"] for r in train]
    episodes = {r["step"]: [c["episode"] for c in r["completions"]] for r in _records(s.run_dir, "completions")}
    said = [m["content"] for e in episodes[1] for m in e if m["role"] == "tool"]
    assert "{'error': 'timed out after 2 s'}" in said, said
    assert any("exited with code 0" in t for t in said) and any("SIGSEGV" in t for t in said), said
    three = [e for e in episodes[2] if sum(m.get("tool_calls") is not None for m in e) == 3]
    assert three and all(e[-1]["content"] == "Done." and e[-2]["content"] == "The door is open." for e in three)
    assert sorted(q.name for q in RunPaths(s.run_dir).tools.iterdir()) == ["0-RankVault.pkl", "0-RankVault.py"]
    log = (d / "logs" / "rank-0.log").read_text()
    assert "tool_timeout" in log and "knock 3 on rank 0" in log              # the tools' prints: the rank's log,
    assert "o" * 2_000_000 in log and "e" * 2_000_000 in log                  # megabytes of them too
    s.report()
    report = RunPaths(s.run_dir).report.read_text()
    assert "Tool or environment" in report and "class RankVault" in report          # its source, as a reward's


def test_a_fork_sweep_over_tool_timeout_samples_the_same_episodes(agent_run):
    """The fork sweep's run from step 1 (other processes, no faults, tool_timeout 5 s) samples step 2 as the run did:
    episodes, loss, rewards and tool frequencies; it has its own copy of the environment, and its config points there;
    its TensorBoard shows each kept episode turn by turn at its step."""
    s, sw = agent_run
    assert sw.spec["axes"] == {"tool_timeout": [5]} and sw.spec["forked_from"]["step"] == 1
    _same_episodes_as(s, sw.sessions[0], 5)


def _same_episodes_as(s, f, timeout):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from ilab_nb.episodes import episode_text
    comp = {r["step"]: r["completions"] for r in _records(s.run_dir, "completions")}
    again = {r["step"]: r["completions"] for r in _records(f.run_dir, "completions")}
    assert sorted(again) == [2] and again[2] == comp[2]
    train, fork_train = _records(s.run_dir, "train"), {r["step"]: r for r in _records(f.run_dir, "train")}
    for r in train[1:]:
        for k in ("loss", "reward", "tools/call_frequency", "tools/failure_frequency"):
            assert fork_train[r["step"]][k] == pytest.approx(r[k], rel=1e-5, abs=1e-7), (r["step"], k)
    cfg = json.loads((Path(f.run_dir) / "config.json").read_text())
    assert cfg["tool_timeout"] == timeout and cfg["environment_factory"].startswith(str(f.run_dir))
    assert sorted(q.name for q in Path(f.run_dir, "tools").iterdir()) == ["0-RankVault.pkl", "0-RankVault.py"]
    acc = EventAccumulator(str(Path(f.run_dir) / "tensorboard")); acc.Reload()
    for i, c in enumerate(again[2]):
        (t,) = acc.Tensors(f"completions/{i}/text_summary")
        text = t.tensor_proto.string_val[0].decode()
        assert t.step == 2 and text.startswith(f"**{c['prompt']}**") and episode_text(c["episode"]) in text, text
    assert [e.step for e in acc.Scalars("train/tools/call_frequency")] == [2]


def test_the_agent_learns_to_use_its_tool_from_a_yaml_config(agent, tmp_path, monkeypatch):
    """`ilab-nb run` of a YAML config naming the environment as 'module:Class' (its get_reward the only reward): the
    held-out greedy episodes start without the tool (reward 0, no call) and end calling it (the vault opened).
    One process with the 2-rank run's global batch (2 prompts x 8 episodes a step): a second rank would prove nothing
    about learning (the 2-rank agent run is `agent_run`'s) and costs a process that imports torch.
    Measured on an AMD EPYC here, at a constant learning rate, with 2 ranks of 8 episodes: the held-out reward is 0
    after steps 1 and 2 and 1.0 from step 3 on (seeds 0, 1 and 2 alike); with one process of 16 (this test): 0 after
    step 1 and 1.0 from step 2 on (seeds 0, 1 and 2 alike). With the default linear decay to 0 at step 3 (the test as
    first written, which passed on the machine it was written on) it stayed 0 here: step 4 at a constant rate leaves
    margin."""
    import yaml
    from ilab_nb import FineTuneSession
    from ilab_nb.cli import main
    from conftest import kill_processes_under, runs_env
    cfg = {**AGENT_RUN, "model": str(agent.model_dir), "data": str(agent.train_file), "eval_data": str(agent.eval_file),
           "environment_factory": "ilab_nb.agent_demo:AgentVault", "num_generations": 8, "num_processes": 1,
           "per_device_train_batch_size": 16, "max_steps": 4, "eval_steps": 4, "save_steps": None, "seed": 0,
           "max_completion_length": 32, "tool_timeout": 10, "lr_scheduler_type": "constant"}
    (tmp_path / "agent.yaml").write_text(yaml.safe_dump(cfg))
    for k, v in runs_env(tmp_path).items(): monkeypatch.setenv(k, v)
    try:        # the command line's `main`, here: its own process would only import what this one has
        assert main(["run", str(tmp_path / "agent.yaml"), "--runs-root", str(tmp_path / "runs"), "--name", "agent"]) == 0
        s = FineTuneSession.attach(next(p.name for p in (tmp_path / "runs").iterdir() if "agent" in p.name),
                                   tmp_path / "runs")
        assert s.wait(timeout=600) == "completed", s.reason
    finally: kill_processes_under(tmp_path / "runs")
    ev = {r["step"]: r for r in _records(s.run_dir, "eval")}
    assert sorted(ev) == [0, 4]
    assert ev[0]["eval_rewards/AgentVault/mean"] == 0 and ev[0]["eval_tools/call_frequency"] == 0
    assert ev[4]["eval_rewards/AgentVault/mean"] >= 0.75 and ev[4]["eval_tools/call_frequency"] >= 0.75, ev[4]
    assert all(math.isfinite(r["tools/call_frequency"]) for r in _records(s.run_dir, "train"))


def test_the_preflight_refuses_unusable_tools_before_launch(agent, demo, tmp_path):
    """A tool without a docstring, an undocumented argument, text prompts, a row routed to no environment and no reward
    source, all said at once; a model whose chat template trl cannot parse tool calls from; each refused before
    launch, named. A tool_timeout at or above ddp_timeout is refused by the config itself."""
    from ilab_nb.config import ConfigError, TrainConfig
    from ilab_nb.data import load_tokenizer
    from ilab_nb.preflight import PreflightError, check_reward_funcs
    tok = load_tokenizer(str(agent.model_dir))
    chat = [{"kind": "prompt", "prompt": [{"role": "user", "content": "Open the amber vault."}],
             "columns": {"vault": "amber"}, "source": "p.jsonl:1"}]
    base = dict(model=str(agent.model_dir), data=["p.jsonl"], method="grpo", num_generations=2,
                per_device_train_batch_size=2, num_processes=1, max_seq_len=256, max_completion_length=32)

    def refused(records, tokenizer=tok, **kw):
        with pytest.raises(PreflightError) as e:
            check_reward_funcs(TrainConfig(**{**base, **kw}), records, [], False, tokenizer)
        return str(e.value)

    def answer(completions, **kw): return [0.0] * len(completions)
    said = refused([{**chat[0], "prompt": "Open the amber vault."}], tools=[nodoc, half_documented],
                   environment_factory={"vault": Vault2})
    for problem in ("tool 'nodoc': Cannot generate JSON schema for nodoc because it has no docstring!",
                    "tool 'half_documented': Cannot generate JSON schema for half_documented because the docstring "
                    "has no description for the argument 'b'", "no reward source", "tools need chat prompts"):
        assert problem in said, (problem, said)
    said = refused([{**chat[0], "columns": {"environment": "lock"}}], tokenizer=load_tokenizer(str(demo.model_dir)),
                   reward_funcs=[answer], environment_factory={"vault": Vault})
    assert "'lock' is not one of environment_factory's 'vault'" in said
    assert "give its response_template" in refused(chat, tokenizer=load_tokenizer(str(demo.model_dir)),
                                                   reward_funcs=[answer], tools=[open_vault])
    ok = check_reward_funcs(TrainConfig(**base, environment_factory=Vault), chat, [], False, tok)
    assert ok["names"] == [] and ok["tool_timeout"] == 60.0
    with pytest.raises(ConfigError, match="tool_timeout.*must be below ddp_timeout"):
        TrainConfig(**base, reward_funcs=[answer], tools=[open_vault], tool_timeout=1800)


def half_documented(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first
    """
    return a + b


class Vault2:
    "An environment without get_reward."
    def reset(self, **row): return None

    def open_vault(self) -> str:
        """Open the vault the user names."""
        return "The vault is open."
