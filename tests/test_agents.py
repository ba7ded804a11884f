"""GRPO with tools and environments (issue 52's foundation), in this process and the user-code child it starts: the
chat template check (TRL's response templates), every way a tool can fail (raise, hang past tool_timeout, sys.exit,
os._exit, a segfault) as a failed call whose result the model reads while the caller goes on, an environment's state
made again after its process was lost, its get_reward as a reward column, a GRPO generation batch of episodes on a
tiny model with TRL's Qwen2.5 chat template (tools/ metrics, tool_mask out of the loss), and the preflight naming a
tool without a docstring."""
import json
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
