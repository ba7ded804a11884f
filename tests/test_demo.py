"""The demo's assets: shipped data, tokenizer and tiny Llama built offline, and the exact-answer evaluation."""
import json, subprocess, sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ilab_nb.demo import (CHAT_TEMPLATE, DATA_FILES, DEMO_CONFIG, DemoAssets, answer_loss, answer_prompts, demo_assets, evaluate_answers,
                          read_chat_jsonl, shipped_data_dir)

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def assets(demo) -> DemoAssets:
    "The suite's demo assets (conftest's `demo`, built once per session); the tests below only read them."
    return demo


@pytest.mark.processes
def test_shipped_data_is_what_the_generator_writes(tmp_path):
    subprocess.run([sys.executable, str(REPO / "tools" / "make_demo_data.py"), "--out", str(tmp_path)],
                   check=True, capture_output=True, timeout=60)
    for name in DATA_FILES:
        assert (tmp_path / name).read_bytes() == (shipped_data_dir() / name).read_bytes(), name


def test_shipped_data_shape():
    train, evals = (read_chat_jsonl(shipped_data_dir() / n) for n in ("train.jsonl", "eval.jsonl"))
    assert len(train) == 2400 and len(evals) == 200
    key = lambda c: json.dumps(c, sort_keys=True)
    assert not {key(c) for c in evals} & {key(c) for c in train}          # held-out conversations
    for c in train + evals:
        roles = [m["role"] for m in c if m["role"] != "system"]
        assert roles == ["user", "assistant"] * (len(roles) // 2) and 2 <= len(roles) // 2 <= 3
        assert all(len(m["content"].split()) == 1 for m in c if m["role"] == "assistant")
    answers = {m["content"] for c in train for m in c if m["role"] == "assistant"}
    assert {m["content"] for c in evals for m in c if m["role"] == "assistant"} <= answers


def test_model_and_tokenizer_load_like_a_downloaded_model(assets):
    assert assets.train_file.read_bytes() == (shipped_data_dir() / "train.jsonl").read_bytes()
    assert assets.eval_file.read_bytes() == (shipped_data_dir() / "eval.jsonl").read_bytes()
    model = AutoModelForCausalLM.from_pretrained(assets.model_dir)
    tok = AutoTokenizer.from_pretrained(assets.model_dir)
    assert type(model).__name__ == "LlamaForCausalLM" and (assets.model_dir / "model.safetensors").exists()
    assert tok.is_fast and tok.chat_template == CHAT_TEMPLATE and model.config.vocab_size == len(tok)
    assert model.generation_config.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|end|>")
    assert model.generation_config.pad_token_id == tok.pad_token_id != tok.eos_token_id
    assert 500_000 < sum(p.numel() for p in model.parameters()) < 5_000_000


def test_generation_prompt_ends_where_the_answer_starts(assets):
    tok = AutoTokenizer.from_pretrained(assets.model_dir)
    conv = read_chat_jsonl(assets.eval_file)[0]
    for k, m in enumerate(conv):
        if m["role"] != "assistant": continue
        prompt = tok.apply_chat_template(conv[:k], tokenize=False, add_generation_prompt=True)
        through = tok.apply_chat_template(conv[:k + 1], tokenize=False)
        assert through == prompt + m["content"] + tok.eos_token
        assert tok.apply_chat_template(conv, tokenize=False).startswith(through)
        ids = tok(through, add_special_tokens=False)["input_ids"]
        assert ids[:len(tok(prompt, add_special_tokens=False)["input_ids"])] == tok(prompt, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids[-1]) == "<|end|>" and tok.decode(ids[0]) == tok.bos_token


def test_data_module_labels_exactly_the_answers(assets):
    "The trainer's tokenization (ilab_nb.data) learns each answer and its <|end|>, nothing else."
    from ilab_nb.data import tokenize_chat
    tok = AutoTokenizer.from_pretrained(assets.model_dir)
    for conv in read_chat_jsonl(assets.train_file)[:50]:
        r = tokenize_chat(conv, tok)
        learned = tok.decode([t for t in r["labels"] if t != -100])
        assert learned == "".join(m["content"] + "<|end|>" for m in conv if m["role"] == "assistant")
        mask = tok.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert [t if k else -100 for t, k in zip(mask["input_ids"], mask["assistant_masks"])] == r["labels"]


def test_idempotent_and_deterministic(assets, tmp_path):
    weights = assets.model_dir / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert demo_assets(assets.root) == assets and weights.stat().st_mtime_ns == stamp       # reused, not rebuilt
    again = demo_assets(tmp_path / "other")                                                 # same seed, same bytes
    for f in ("model.safetensors", "tokenizer.json", "config.json", "generation_config.json"):
        assert (again.model_dir / f).read_bytes() == (assets.model_dir / f).read_bytes(), f
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.lock", "other"]           # no temp folder left


def test_incomplete_or_outdated_folder_is_rebuilt(tmp_path):
    root = tmp_path / "demo"
    (root / "model").mkdir(parents=True); (root / "model" / "half-written").write_text("x")
    a = demo_assets(root)                       # no COMPLETE marker: replaced by a complete build
    assert not (a.model_dir / "half-written").exists() and (a.model_dir / "model.safetensors").exists()
    (root / "COMPLETE").write_text(json.dumps({"version": 0, "data_sha256": "old"}))
    stamp = (a.model_dir / "model.safetensors").stat().st_mtime_ns
    demo_assets(root)                           # outdated marker: rebuilt
    assert (a.model_dir / "model.safetensors").stat().st_mtime_ns != stamp
    stamp = (a.model_dir / "model.safetensors").stat().st_mtime_ns
    demo_assets(root, force=True)               # force: rebuilt
    assert (a.model_dir / "model.safetensors").stat().st_mtime_ns != stamp
    assert sorted(p.name for p in tmp_path.iterdir()) == [".demo.lock", "demo"]


def test_a_folder_of_other_files_is_never_replaced(tmp_path):
    (tmp_path / "mine").mkdir(); (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a demo folder"): demo_assets(tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError): demo_assets(tmp_path / "file")
    assert (tmp_path / "file").read_text() == "x"
    assert (demo_assets(tmp_path / "empty").model_dir / "model.safetensors").exists()


def test_untrained_model_answers_almost_nothing(assets):
    r = evaluate_answers(assets.model_dir, eval_file=assets.eval_file, limit=30, max_new_tokens=4)
    convs = read_chat_jsonl(assets.eval_file)[:30]
    assert r["n"] == sum(m["role"] == "assistant" for c in convs for m in c) == len(r["examples"]) > 60
    assert r["accuracy"] <= 0.05 and r["correct"] == sum(e["correct"] for e in r["examples"])
    assert 5.5 < answer_loss(assets.model_dir, eval_file=assets.eval_file, limit=30) < 8   # ~ log(800) = 6.68


class AnswerKey(torch.nn.Module):
    """Not a model: a stand-in whose `generate` appends the expected answer (or a wrong one) to each prompt,
    to check that evaluate_answers slices, decodes and compares generated text correctly."""
    def __init__(self, tok, key, wrong_every):
        super().__init__(); self.tok, self.key, self.wrong_every, self.calls = tok, key, wrong_every, 0
    @property
    def device(self): return torch.device("cpu")
    def generate(self, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id, **kw):
        rows = []
        for ids, m in zip(input_ids, attention_mask):
            assert m[-1] == 1                                    # left padding: every prompt ends at the right edge
            prompt = self.tok.decode(ids[m.bool()])
            answer = self.key[prompt]; self.calls += 1
            if self.calls % self.wrong_every == 0: answer = answer + "x"
            rows.append(self.tok(answer, add_special_tokens=False)["input_ids"] + [eos_token_id])
        width = max(map(len, rows))
        new = torch.tensor([r + [pad_token_id] * (width - len(r)) for r in rows])
        return torch.cat([input_ids, new], dim=1)


def test_evaluate_answers_scores_right_and_wrong_answers(assets):
    tok = AutoTokenizer.from_pretrained(assets.model_dir)
    convs = read_chat_jsonl(assets.eval_file)[:20]
    key = {tok.apply_chat_template(it["context"], tokenize=False, add_generation_prompt=True): it["expected"]
           for it in answer_prompts(convs)}
    r = evaluate_answers(AnswerKey(tok, key, wrong_every=4), tok, assets.eval_file, limit=20, batch_size=7)
    assert r["n"] == len(key) and r["correct"] == r["n"] - r["n"] // 4
    assert all(e["correct"] == (e["answer"] == e["expected"]) for e in r["examples"])
    assert tok.padding_side == "right"                         # restored


def test_demo_config_is_a_valid_train_config(assets):
    from ilab_nb.config import TrainConfig
    cfg = TrainConfig(**assets.train_config())
    assert cfg.model == str(assets.model_dir) and cfg.eval_data == [str(assets.eval_file)]
    assert cfg.num_processes == 2 and cfg.strategy == "fsdp" and cfg.max_seq_len <= cfg.max_tokens_per_batch
    assert assets.train_config(max_steps=3)["max_steps"] == 3 and DEMO_CONFIG["max_steps"] != 3
