"""GGUF export read by llama.cpp (through llama-cpp-python), a reader that shares no code with the writer: its logits,
its tokenization and its chat answers against transformers' on the demo model, tiny Qwen2, Qwen3, Mistral, Llama 3
rope, linear rope and biased Llama models, and on tokenizers with each recognised pre-tokenizer; the
`python -m ilab_nb.export` command line; and the demo run's trained model exported through the session and
`ilab-nb export`, read back by transformers' GGUF reader and by llama.cpp (the LoRA run's and a checkpoint's:
tests/test_lora.py).

Tolerances: max |logit difference| over a 64-89 token prompt (logits of magnitude ~1-2), against the HF model in F32.
What was seen on these nine models is in brackets.
- F32 file, llama.cpp with an F32 KV cache: 1e-5 [2.1e-7 - 6.0e-7]. With its default F16 KV cache: 3e-3 [3.1e-4].
- F16 file: 5e-3 [2.4e-4 - 7.3e-4] (llama.cpp multiplies F16 weights with activations rounded to F16).
- BF16 file: 2e-2 [1.8e-3 - 5.4e-3] (8 bits of mantissa).
- Q8_0 file: 0.1 [6.8e-3 - 2.0e-2] (weights and activations in 8-bit blocks of 32).
The models' vectors are perturbed (a random model's biases are 0 and its norms 1): an export that left the Llama's q/k
biases in transformers' order was off by 1.1e-3 in F32, so the F32 tolerance catches it.
"""
import json, os, re, subprocess, sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO, within, max_abs_diff

try: import llama_cpp
except ImportError: llama_cpp = None
needs_llama_cpp = pytest.mark.skipif(llama_cpp is None, reason="llama-cpp-python is not installed: the llama.cpp reader "
                                     "checks need it (`make llama-deps` builds it once per machine)")

from ilab_nb.demo import read_chat_jsonl, SPECIAL_TOKENS
from ilab_nb.export import export_gguf, write_modelfile, LLAMA3_PATTERN, QWEN2_PATTERN

TOL = {"f32": 1e-5, "f16": 5e-3, "bf16": 2e-2, "q8_0": 0.1}
SEEN = {"f32": "6.0e-7", "f16": "7.3e-4", "bf16": "5.4e-3", "q8_0": "2.0e-2"}   # the worst of the nine models
F16_KV_TOL = 3e-3
STRESS = ["It's 2024-01-05: 12345 apples,\n\n  and   they'll  say\t\tDONE. I'M here 3.14159!",
          "Ünïcödé café naïve — 你好 🙂 ok", "  leading spaces\nand\r\nwindows lines   ", "<|user|>inline <|end|> specials"]


# --- the models ------------------------------------------------------------------------------------------------------

def _tiny(kind, path, tokenizer, **shape):
    """A tiny random `kind` model with 800 tokens, `tokenizer` saved beside it. Its vectors are perturbed (biases start
    at 0, norms at 1), so a bias not permuted or a norm in the wrong place changes the logits."""
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.for_model(kind, **{**dict(vocab_size=800, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                                bos_token_id=1, eos_token_id=5, pad_token_id=0), **shape})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg)
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim == 1: p.add_(torch.randn_like(p) * 0.3)
        model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _retrained(demo, pre_tokenizer, add_bos=False):
    "The demo's tokenizer retrained with another pre-tokenizer (800 tokens, the same specials, chat template, BOS/EOS)."
    from tokenizers import Tokenizer, decoders, models, processors, trainers, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    base = AutoTokenizer.from_pretrained(demo.model_dir)
    tok = Tokenizer(models.BPE()); tok.pre_tokenizer = pre_tokenizer; tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=800, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((m["content"] for c in read_chat_jsonl(demo.train_file) for m in c), trainer=trainer)
    if add_bos: tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|end|>",
                                   pad_token="<|pad|>", chat_template=base.chat_template, model_max_length=512)


@pytest.fixture(scope="module")
def models(demo, tmp_path_factory):
    "name -> model folder: the demo (Llama, tied), Qwen2, Qwen3, Mistral, a Llama 3 rope, and the other pre-tokenizers."
    from tokenizers import Regex, pre_tokenizers as P
    from transformers import AutoTokenizer
    root, tok = tmp_path_factory.mktemp("export-models"), AutoTokenizer.from_pretrained(demo.model_dir)
    split = lambda p: P.Sequence([P.Split(Regex(p), behavior="isolated"), P.ByteLevel(add_prefix_space=False, use_regex=False)])
    rope3 = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                 original_max_position_embeddings=64)
    return {
        "demo": demo.model_dir,
        "qwen2": _tiny("qwen2", root / "qwen2", tok),                                   # q, k, v biases
        "qwen3": _tiny("qwen3", root / "qwen3", tok, head_dim=32),                    # head_dim 32, hidden / heads 16
        "mistral": _tiny("mistral", root / "tiny-m", tok, sliding_window=64),
        "llama3-rope": _tiny("llama", root / "llama3", _retrained(demo, split(LLAMA3_PATTERN), add_bos=True),
                             rope_parameters=rope3, tie_word_embeddings=False),
        "qwen2-pre": _tiny("llama", root / "qwen2pre", _retrained(demo, split(QWEN2_PATTERN))),
        "smollm": _tiny("llama", root / "smollm", _retrained(demo, P.Sequence([P.Digits(individual_digits=True),
                        P.ByteLevel(add_prefix_space=False, use_regex=True)])), tie_word_embeddings=True),
        "llama-bias": _tiny("llama", root / "llamabias", tok, attention_bias=True),             # q and k biases permuted too
        "llama-linear": _tiny("llama", root / "llamalin", tok, rope_parameters=dict(rope_type="linear", factor=4.0, rope_theta=10000.0)),
    }


_files = {}

def exported(models, name, dtype, tmp_path_factory):
    "The model `name` exported as `dtype` (once per module)."
    if (name, dtype) not in _files:
        _files[name, dtype] = export_gguf(models[name], tmp_path_factory.mktemp("gguf") / f"{name}-{dtype}.gguf", dtype)
    return _files[name, dtype]


def llama(path, f32_cache=True):
    "llama.cpp on the file: every position's logits, one thread, an F32 KV cache unless asked for llama.cpp's default."
    kv = dict(type_k=0, type_v=0) if f32_cache else {}     # 0: GGML_TYPE_F32
    return llama_cpp.Llama(str(path), logits_all=True, n_ctx=512, n_threads=1, verbose=False, **kv)


def prompt_ids(demo, tok, limit=89):
    "The first held-out conversation rendered by the chat template, as ids (within the tiny Mistral's window of 64)."
    ids = tok.apply_chat_template(read_chat_jsonl(demo.eval_file)[0], tokenize=True, return_dict=True)["input_ids"]
    return ids[:limit]


def hf(models, name):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    return AutoModelForCausalLM.from_pretrained(models[name]).eval(), AutoTokenizer.from_pretrained(models[name])


def max_logit_diff(model, llm, ids):
    llm.reset(); llm.eval(ids)
    with torch.no_grad(): ref = model(torch.tensor([ids])).logits[0].numpy()
    return float(np.abs(np.asarray(llm.scores[:len(ids)]) - ref).max())


NAMES = ["demo", "qwen2", "qwen3", "mistral", "llama3-rope", "qwen2-pre", "smollm", "llama-bias", "llama-linear"]


# --- logits ----------------------------------------------------------------------------------------------------------

@needs_llama_cpp
@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "q8_0"])
@pytest.mark.parametrize("name", NAMES)
def test_llama_cpp_logits_equal_transformers(models, name, dtype, demo, tmp_path_factory):
    model, tok = hf(models, name)
    ids = prompt_ids(demo, tok, 64 if name == "mistral" else 89)
    llm = llama(exported(models, name, dtype, tmp_path_factory))
    try: d = max_logit_diff(model, llm, ids)
    finally: llm.close()
    within(f"llama.cpp {name} {dtype} logits vs transformers ({len(ids)} tokens)", d, TOL[dtype], SEEN[dtype])


@needs_llama_cpp
def test_f16_kv_cache_is_the_f32_files_only_rounding(models, demo, tmp_path_factory):
    "llama.cpp's default F16 KV cache: the F32 file's logits within 3e-3 (the cache's rounding, not the file's)."
    model, tok = hf(models, "demo")
    llm = llama(exported(models, "demo", "f32", tmp_path_factory), f32_cache=False)
    try: d = max_logit_diff(model, llm, prompt_ids(demo, tok))
    finally: llm.close()
    within("llama.cpp demo f32 logits with an F16 KV cache vs transformers", d, F16_KV_TOL, "3.1e-4")
    assert d > 1e-5, d                                       # the cache's rounding shows: this is not the F32 cache


def test_llama3_rope_factors_matter(models):
    "The Llama 3 model's rope differs from plain rope (so its logits check above tests the rope_freqs tensor)."
    from transformers import AutoConfig, AutoModelForCausalLM
    model, _ = hf(models, "llama3-rope")
    plain_cfg = AutoConfig.from_pretrained(models["llama3-rope"]); plain_cfg.rope_parameters = dict(rope_type="default", rope_theta=10000.0)
    plain = AutoModelForCausalLM.from_config(plain_cfg).eval(); plain.load_state_dict(model.state_dict())
    ids = torch.arange(2, 90)[None]
    with torch.no_grad(): assert (model(ids).logits - plain(ids).logits).abs().max() > 1e-3


# --- tokenization ----------------------------------------------------------------------------------------------------

@needs_llama_cpp
@pytest.mark.parametrize("name", NAMES)
def test_llama_cpp_tokenizes_as_transformers(models, name, demo, tmp_path_factory):
    from ilab_nb.export import tokenizer_vocab
    _, tok = hf(models, name)
    convs = read_chat_jsonl(demo.eval_file)
    texts = [tok.apply_chat_template(c, tokenize=False) for c in convs] + [m["content"] for c in convs[:50] for m in c] + STRESS
    f = exported(models, name, "f32", tmp_path_factory)
    llm = llama_cpp.Llama(str(f), vocab_only=True, verbose=False)
    try:
        mine = [llm.tokenize(t.encode(), add_bos=True, special=True) for t in texts]
    finally: llm.close()
    theirs = [tok(t)["input_ids"] for t in texts]
    bad = [(t, a, b) for t, a, b in zip(texts, mine, theirs) if a != b]
    assert not bad, f"{len(bad)} of {len(texts)} texts tokenized differently, first: {bad[0]}"
    expected = {"demo": "gpt-2", "qwen2": "qwen2", "qwen3": "gpt-2", "mistral": "gpt-2", "llama3-rope": "llama-bpe",
                "qwen2-pre": "qwen2", "smollm": "smollm", "llama-bias": "gpt-2", "llama-linear": "gpt-2"}[name]
    assert tokenizer_vocab(models[name], 800)["pre"] == expected


# --- chat ------------------------------------------------------------------------------------------------------------

@needs_llama_cpp
@pytest.mark.parametrize("name", ["demo", "qwen2", "qwen3", "mistral", "llama3-rope"])
def test_chat_completion_equals_transformers_greedy(models, name, demo, tmp_path_factory):
    """The file's own chat template and stop token in llama.cpp, greedy: the same answer as transformers' greedy.

    A random model's answer can hold a token that is half of a UTF-8 character: llama-cpp-python then generates past
    `max_tokens` to complete it (its usage says how many tokens) and drops the bytes it cannot decode, where
    transformers decodes them as U+FFFD. So transformers generates as many tokens as llama.cpp did, and U+FFFD is left
    out of its text. The Mistral's conversation is one user turn, to stay within its sliding window of 64 tokens."""
    model, tok = hf(models, name)
    msgs = read_chat_jsonl(demo.eval_file)[1][1 if name == "mistral" else 0:2]       # (system,) user
    llm = llama(exported(models, name, "f32", tmp_path_factory))
    try:
        got = llm.create_chat_completion(messages=msgs, temperature=0, max_tokens=16, repeat_penalty=1.0)
    finally: llm.close()
    n = got["usage"]["completion_tokens"]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=n, do_sample=False)[0, ids["input_ids"].shape[1]:]
    want = tok.decode(out, skip_special_tokens=True).replace("\ufffd", "")
    print(f"{name}: {n} tokens, {got['choices'][0]['finish_reason']}: {got['choices'][0]['message']['content']!r}")
    assert got["choices"][0]["message"]["content"] == want
    assert (got["choices"][0]["finish_reason"] == "stop") == (out[-1].item() == tok.convert_tokens_to_ids("<|end|>"))


def test_modelfile_leaves_out_bos_that_llama_cpp_adds(models, tmp_path_factory):
    "A tokenizer that adds BOS (Llama 3's): the Modelfile's template starts after it; the demo's keeps its BOS text."
    mf = write_modelfile(exported(models, "llama3-rope", "f32", tmp_path_factory), models["llama3-rope"]).read_text()
    assert 'TEMPLATE """{{ $role := "" }}' in mf, mf
    demo_mf = write_modelfile(exported(models, "demo", "f32", tmp_path_factory), models["demo"]).read_text()
    assert 'TEMPLATE """<|begin_of_text|>{{ $role' in demo_mf


# --- the command line ------------------------------------------------------------------------------------------------

@pytest.mark.processes
def test_command_line_prints_progress_and_json(demo, tmp_path):
    """One line a tensor, then the JSON line. Its peak memory is the export's own: started from this process while it
    holds 768 MiB more (whose peak a child's `getrusage` would report on Linux), the export reports well under that."""
    out, held = tmp_path / "demo-q8_0.gguf", bytearray(768 << 20)
    for i in range(0, len(held), 4096): held[i] = 1                    # touched: resident
    p = subprocess.run([sys.executable, "-m", "ilab_nb.export", str(demo.model_dir), str(out), "--dtype", "q8_0"],
                       cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[:2] == ["tensor 1/38", "tensor 2/38"] and lines[37] == "tensor 38/38" and len(lines) == 39
    res = json.loads(lines[-1])
    assert {k: res[k] for k in ("path", "dtype", "bytes", "tensors", "fallbacks")} == dict(
        path=str(out), dtype="q8_0", bytes=out.stat().st_size, tensors=38, fallbacks={})
    del held
    assert 50 < res["peak_rss_mb"] < 700 and res["seconds"] > 0, res
    from gguf import GGUFReader
    r = GGUFReader(out)
    assert len(r.tensors) == 38 and r.fields["general.file_type"].contents() == 7


def test_command_line_refuses_with_a_sentence(demo, tmp_path, capsys):
    "A refused export (in this process: `main` is what the command runs): exit status 2, the reason on stderr, no file."
    from ilab_nb.export import main
    assert main([str(demo.model_dir), str(tmp_path / "x.gguf"), "--dtype", "q4"]) == 2
    err = capsys.readouterr()
    assert "error: dtype 'q4' is not one of f32, f16, bf16, q8_0" in err.err and not err.out
    assert list(tmp_path.iterdir()) == []


def test_an_export_into_the_users_folder_through_a_link_writes_there(demo, tmp_path, capsys):
    """`export(path=...)` into the user's own folder reached through a symbolic link to it (not a run directory): the GGUF
    file and its Modelfile are written in the folder the link leads to, and the export says where (the rule against links
    is a run directory's: it wrote the file, then failed on the Modelfile saying to remove the link). In this process:
    `main` is what the export process runs."""
    from ilab_nb.export import main
    real = tmp_path / "real"; real.mkdir(); (tmp_path / "mine").symlink_to(real, target_is_directory=True)
    assert main([str(demo.model_dir), str(tmp_path / "mine" / "m.gguf"), "--dtype", "f32", "--modelfile"]) == 0
    said, there = json.loads(capsys.readouterr().out.splitlines()[-1]), Path(os.path.realpath(real))
    assert (said["path"], said["modelfile"]) == (str(there / "m.gguf"), str(there / "m.Modelfile"))
    assert (tmp_path / "mine" / "m.gguf").read_bytes()[:4] == b"GGUF" and (tmp_path / "mine").is_symlink()
    assert (tmp_path / "mine" / "m.Modelfile").read_text().startswith("FROM ./m.gguf\n")


# --- the demo run's model --------------------------------------------------------------------------------------------

DEMO_LIMIT = 40          # conversations: the demo_run's --eval-limit (tests/conftest.py)


def llama_answers(path, items, max_tokens=10):
    "llama.cpp's greedy answer to each item's context (`answer_prompts`), with the file's own chat template."
    llm = llama_cpp.Llama(str(path), n_ctx=512, n_threads=1, verbose=False)
    try: return [llm.create_chat_completion(messages=it["context"], temperature=0, max_tokens=max_tokens, repeat_penalty=1.0)
                 ["choices"][0]["message"]["content"].strip() for it in items]
    finally: llm.close()


@needs_llama_cpp
@pytest.mark.processes
def test_the_demo_runs_model_read_back_by_transformers_and_llama_cpp(demo_run, demo, capsys):
    """The demo run's final model exported through `ilab-nb export` (f32) and the session (f16, q8_0). Transformers'
    GGUF reader: the f32 file's logits equal the final model's (1e-5; bitwise equal seen) and its tokenizer tokenizes
    every held-out conversation as the final tokenizer does; the q8_0 file answers the held-out questions within 2
    points of the final model. llama.cpp, with the file's own template, greedy: the f32 and f16 files give the final
    model's answers, the q8_0 file its accuracy within 2 points."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from ilab_nb import FineTuneSession
    from ilab_nb.demo import answer_prompts, evaluate_answers
    r, run_dir = demo_run
    after = float(re.search(r"held-out accuracy:\s+([\d.]+) ?% -> ([\d.]+) ?%", r.stdout).group(2))
    from ilab_nb.cli import main       # `ilab-nb export` here: the export has its own process either way
    capsys.readouterr()
    assert main(["export", run_dir.name, "--runs-root", str(run_dir.parent), "--dtype", "f32"]) == 0
    said = capsys.readouterr().out
    f32 = Path(said.splitlines()[0])
    assert f32 == run_dir / "export" / f"{run_dir.name}-final-f32.gguf" and f32.with_suffix(".Modelfile").exists()
    assert f"ollama create {f32.stem.lower()} -f {f32.with_suffix('.Modelfile')}" in said
    s = FineTuneSession.attach(run_dir.name, runs_root=run_dir.parent)
    f16, q8 = s.export(dtype="f16", progress=False), s.export(progress=False)
    assert q8.name == f"{run_dir.name}-final-q8_0.gguf" and q8.stat().st_size < 0.35 * f32.stat().st_size
    final, tok = s.load_model()
    held = read_chat_jsonl(demo.eval_file)
    # transformers' reader: logits and tokenization
    back = AutoModelForCausalLM.from_pretrained(f32.parent, gguf_file=f32.name, dtype=torch.float32).eval()
    gtok = AutoTokenizer.from_pretrained(f32.parent, gguf_file=f32.name)
    texts = [tok.apply_chat_template(c, tokenize=False) for c in held]
    assert [gtok(t)["input_ids"] for t in texts] == [tok(t)["input_ids"] for t in texts]
    with torch.no_grad():
        diff = max((back(input_ids=torch.tensor([tok(t)["input_ids"]])).logits
                    - final.eval()(input_ids=torch.tensor([tok(t)["input_ids"]])).logits).abs().max().item() for t in texts[:8])
    within("transformers' GGUF reader: the demo run's f32 file's logits vs final/", diff, 1e-5, "0.0: bitwise equal")
    want = evaluate_answers(final, tok, demo.eval_file, limit=DEMO_LIMIT)
    q8_back = AutoModelForCausalLM.from_pretrained(q8.parent, gguf_file=q8.name, dtype=torch.float32)
    got_q8 = evaluate_answers(q8_back, tok, demo.eval_file, limit=DEMO_LIMIT)
    within("final/ held-out accuracy vs the demo's own measure (points)", abs(100 * want["accuracy"] - after), 2, "0.03")
    within("q8_0 via transformers: held-out accuracy vs final/ (points)", abs(100 * (got_q8["accuracy"] - want["accuracy"])), 2, "0.0")
    # llama.cpp: answers
    items = answer_prompts(held[:DEMO_LIMIT])
    answers = [e["answer"] for e in want["examples"]]
    for f in (f32, f16):
        got = llama_answers(f, items)
        same = sum(a == b for a, b in zip(got, answers))
        assert same == len(items), (f.name, [(a, b) for a, b in zip(got, answers) if a != b][:5])
    acc_q8 = sum(a == it["expected"] for a, it in zip(llama_answers(q8, items), items)) / len(items)
    print(f"\n[measured] {len(items)} held-out questions: final {want['accuracy']:.1%}; q8_0 via transformers "
          f"{got_q8['accuracy']:.1%}, via llama.cpp {acc_q8:.1%}; f32 logits max diff {diff:.2e}")
    within("q8_0 via llama.cpp: held-out accuracy vs final/ (points)", abs(100 * (acc_q8 - want["accuracy"])), 2, "0.0")
