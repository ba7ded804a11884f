"""Behaviour of ilab_nb.data: validation of chat files, assistant-only labels, dataset building, splits, tokenizers."""
import json
import logging
import pickle

import datasets
import pandas as pd
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from ilab_nb.data import (DEFAULT_CHAT_TEMPLATE, MAX_DATA_ERRORS, DataError, build_dataset, ensure_chat_template,
                          load_chat_records, load_tokenizer, render_chat, split_records, tokenize_chat)
from ilab_nb.data import SHAPES, length_note, load_records, write_chat_jsonl
from ilab_nb.config import ConfigError, InMemoryData, TrainConfig

SPECIAL = ["<pad>", "<eos>", "<|im_start|>", "<|im_end|>"]
_BACKEND = None


def make_tokenizer(chat_template=None, **kw):
    """A byte-level BPE tokenizer built offline, with the ChatML markers as special tokens."""
    global _BACKEND
    if _BACKEND is None:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(
            ["You are a helpful assistant.", "What is the capital of France? Paris is the capital.",
             "And of Italy? Rome, of course.", "system user assistant"],
            trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
        _BACKEND = tok.to_str()
    t = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_BACKEND),
                                **{"eos_token": "<eos>", "pad_token": "<pad>", **kw},
                                additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    t.chat_template = chat_template
    return t


def msg(role, content):
    return {"role": role, "content": content}


CONV = [msg("system", "You are a helpful assistant."), msg("user", "What is the capital of France?"),
        msg("assistant", "Paris is the capital. Très bien!"), msg("user", "And of Italy?"),
        msg("assistant", "Rome, of course 🙂")]


def write_jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r, ensure_ascii=False) for r in rows) + "\n",
                    encoding="utf-8")
    return path


def labelled_runs(t):
    runs, cur = [], []
    for i, l in zip(t["input_ids"], t["labels"]):
        if l != -100:
            assert l == i
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


# ---------------------------------------------------------------- load_chat_records

def test_valid_records_and_formats(tmp_path):
    f = write_jsonl(tmp_path / "a.jsonl", [{"messages": CONV}, "", "   ",
                                          {"input": "q", "output": "a"},
                                          {"input": "q", "output": "a", "system": "s"},
                                          {"messages": [dict(CONV[1], name="x"), CONV[2]]}])
    recs = load_chat_records([f])
    assert [r["source"] for r in recs] == [f"{f}:1", f"{f}:4", f"{f}:5", f"{f}:6"]
    assert recs[0]["messages"] == CONV
    assert recs[1]["messages"] == [msg("user", "q"), msg("assistant", "a")]
    assert recs[2]["messages"][0] == msg("system", "s")
    assert recs[3]["messages"][0] == CONV[1]          # extra keys dropped
    g = write_jsonl(tmp_path / "b.jsonl", [{"input": "x", "output": "y"}])
    assert len(load_chat_records([f, str(g)])) == 5


def test_utf8_bom_is_accepted(tmp_path):
    p = tmp_path / "bom.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + json.dumps({"input": "q", "output": "a"}).encode() + b"\n")
    assert len(load_chat_records(p)) == 1


@pytest.mark.parametrize("line, text", [
    ('{"messages": [', "malformed JSON: Expecting value"),
    ('[1, 2]', "expected a JSON object, got an array"),
    ('"text"', "expected a JSON object, got a string"),
    ('{"body": "hi"}', "a row of unknown shape (keys: 'body')"),
    ('{"text": "hi"}', "is a plain-text document, but the data's first row"),
    ('{"messages": []}', "'messages' must be a non-empty list"),
    ('{"messages": "hi"}', "'messages' must be a non-empty list"),
    ('{"messages": ["hi"]}', "message 1 must be an object with 'role' and 'content', got a string"),
    ('{"messages": [{"content": "x"}]}', "message 1 has no 'role'"),
    ('{"messages": [{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}]}',
     "message 2 has unknown role 'bot' (expected system, user or assistant)"),
    ('{"messages": [{"role": "user"}]}', "message 1 (user) has no 'content'"),
    ('{"messages": [{"role": "user", "content": ""}]}', "message 1 (user) has empty content"),
    ('{"messages": [{"role": "user", "content": 3}]}', "message 1 (user) content must be a string or a list of parts, got a number"),
    ('{"messages": [{"role": "user", "content": "x"}]}', "no assistant message"),
    ('{"messages": [{"role": "user", "content": "x"}, {"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]}',
     "message 2 is a system message; a system message may only come first"),
    ('{"messages": [{"role": "assistant", "content": "a"}]}', "message 1 is an assistant message"),
    ('{"input": "q"}', "'output' is missing"),
    ('{"input": "q", "output": 5}', "'output' must be a string, got a number"),
])
def test_each_problem_names_file_and_line(tmp_path, line, text):
    p = write_jsonl(tmp_path / "train.jsonl", [{"input": "q", "output": "a"}, "", line])
    with pytest.raises(DataError) as ei:
        load_chat_records(p)
    e = ei.value
    assert (e.path, e.line) == (str(p), 3)
    assert str(e).startswith(f"{p}, line 3: ") and text in str(e), str(e)


def test_problems_are_collected_up_to_a_limit(tmp_path):
    bad = '{"messages": [{"role": "bot", "content": "x"}]}'
    p = write_jsonl(tmp_path / "t.jsonl", [{"input": "q", "output": "a"}, bad, '{"oops"', bad])
    with pytest.raises(DataError) as ei:
        load_chat_records([p, tmp_path / "missing.jsonl"])
    e = ei.value
    assert [(x["line"], x["path"]) for x in e.errors] == [(2, str(p)), (3, str(p)), (4, str(p)),
                                                          (None, str(tmp_path / "missing.jsonl"))]
    assert e.line == 2 and "... and 3 more problems:" in str(e) and "missing.jsonl: file not found" in str(e)
    many = write_jsonl(tmp_path / "many.jsonl", [bad] * 50)
    with pytest.raises(DataError) as ei:
        load_chat_records(many)
    assert len(ei.value.errors) == MAX_DATA_ERRORS and ei.value.count == 50
    assert "... and 49 more problems (4 shown):" in str(ei.value) and len(str(ei.value).splitlines()) == 6
    e2 = pickle.loads(pickle.dumps(ei.value))
    assert str(e2) == str(ei.value) and e2.errors == ei.value.errors


def test_file_level_problems(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    with pytest.raises(DataError, match=r"empty\.jsonl: no records") as ei:
        load_chat_records(tmp_path / "empty.jsonl")
    assert ei.value.line is None
    with pytest.raises(DataError, match=r"nope\.jsonl: file not found"):
        load_chat_records(tmp_path / "nope.jsonl")
    (tmp_path / "plain_dir").mkdir()
    with pytest.raises(DataError, match="not a dataset saved with datasets"):
        load_chat_records(tmp_path / "plain_dir")
    with pytest.raises(DataError, match="no data files given"):
        load_chat_records([])
    (tmp_path / "bin.jsonl").write_bytes(b'{"input": "\xff"}\n')
    with pytest.raises(DataError, match=r"bin\.jsonl, line 1: not valid UTF-8"):
        load_chat_records(tmp_path / "bin.jsonl")


def test_saved_dataset_directories(tmp_path):
    datasets.Dataset.from_list([{"messages": CONV}, {"messages": CONV[1:3]}]).save_to_disk(str(tmp_path / "m"))
    recs = load_chat_records(tmp_path / "m")
    assert recs[0]["messages"] == CONV and recs[1]["source"] == f"{tmp_path / 'm'}:2"
    datasets.Dataset.from_list([{"input": "q", "output": "a"}, {"input": "q", "output": ""}]).save_to_disk(str(tmp_path / "io"))
    with pytest.raises(DataError, match=r"io, row 2: 'output' is empty") as ei:
        load_chat_records(tmp_path / "io")
    assert ei.value.line == 2
    datasets.Dataset.from_list([{"body": "x"}]).save_to_disk(str(tmp_path / "txt"))
    with pytest.raises(DataError, match=r"has columns \['body'\], which fit none of the accepted shapes"):
        load_chat_records(tmp_path / "txt")
    datasets.Dataset.from_list([{"text": "x"}]).save_to_disk(str(tmp_path / "plain"))
    with pytest.raises(DataError, match=r"holds plain-text documents \(.*plain:1\), not chat conversations"):
        load_chat_records(tmp_path / "plain")
    datasets.DatasetDict(train=datasets.Dataset.from_list([{"input": "q", "output": "a"}])).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match="DatasetDict"):
        load_chat_records(tmp_path / "dd")


# ---------------------------------------------------------------- chat template and labels

def test_ensure_chat_template_sets_default_only_when_missing():
    tok = make_tokenizer()
    assert ensure_chat_template(tok) == DEFAULT_CHAT_TEMPLATE and tok.chat_template == DEFAULT_CHAT_TEMPLATE
    custom = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok2 = make_tokenizer(chat_template=custom)
    assert ensure_chat_template(tok2) == custom and tok2.chat_template == custom
    text = tok.apply_chat_template(CONV[:2], tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


def test_labels_token_by_token_multi_turn():
    tok = make_tokenizer()
    t = tokenize_chat(CONV, tok)
    assert len(t["input_ids"]) == len(t["labels"])
    assert tok.decode(t["input_ids"]) == tok.apply_chat_template(CONV, tokenize=False)
    runs = labelled_runs(t)
    assert [tok.decode(r) for r in runs] == ["Paris is the capital. Très bien!<|im_end|>\n", "Rome, of course 🙂<|im_end|>\n"]
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    assert im_start not in [i for r in runs for i in r]
    # every unlabelled token is prompt: system/user text and markers, no assistant text
    prompt = tok.decode([i for i, l in zip(t["input_ids"], t["labels"]) if l == -100])
    assert prompt == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                      "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
                      "<|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\n")


def test_spans_with_another_template_and_single_bos():
    tmpl = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}A: {{ m['content'] }}<eos>"
            "{% else %}{{ m['role'][0] | upper }}: {{ m['content'] }}\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}A: {% endif %}")
    tok = make_tokenizer(chat_template=tmpl, bos_token="<pad>")
    text, spans = render_chat(CONV, tok)
    assert [text[a:b] for a, b in spans] == ["Paris is the capital. Très bien!<eos>", "Rome, of course 🙂<eos>"]
    t = tokenize_chat(CONV, tok)
    assert t["input_ids"][0] == tok.bos_token_id and t["input_ids"][1] != tok.bos_token_id
    # the prompt ends in a space, which the tokenizer joins to the answer's first word: that token is learned
    assert [tok.decode(r) for r in labelled_runs(t)] == [" Paris is the capital. Très bien!<eos>", " Rome, of course 🙂<eos>"]


def test_non_incremental_template_is_refused():
    # renders only the last assistant message: earlier renderings are not prefixes of the whole
    tmpl = ("{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}{{ m['content'] }}|{% endif %}"
            "{% endfor %}")
    with pytest.raises(DataError, match="does not render this conversation incrementally"):
        tokenize_chat(CONV, make_tokenizer(chat_template=tmpl))


def test_template_failure_and_slow_tokenizer_are_explained():
    tok = make_tokenizer(chat_template="{{ raise_exception('only user/assistant allowed') }}")
    with pytest.raises(DataError, match="the chat template failed on this conversation: .*only user/assistant"):
        tokenize_chat(CONV, tok)

    class NotFast:
        is_fast = False
    with pytest.raises(DataError, match="not a fast tokenizer"):
        tokenize_chat(CONV, NotFast())


# ---------------------------------------------------------------- build_dataset

def records(*convs):
    return [{"messages": c, "source": f"data/t.jsonl:{i + 1}"} for i, c in enumerate(convs)]


def test_build_dataset_columns_and_stats():
    tok = make_tokenizer()
    recs = records(CONV, CONV[1:3], [msg("user", "hi"), msg("assistant", "yo")])
    ds, stats = build_dataset(recs, tok, max_seq_len=1000)
    assert ds.column_names == ["input_ids", "labels", "length", "num_loss_tokens"]
    for r, rec in zip(ds, recs):
        t = tokenize_chat(rec["messages"], tok)
        assert r["input_ids"] == t["input_ids"] and r["labels"] == t["labels"]
        assert r["length"] == len(r["input_ids"])
        assert r["num_loss_tokens"] == sum(l != -100 for l in r["labels"][1:])
    assert stats == dict(samples=3, dropped_too_long=0, truncated=0, dropped_no_loss=0, tokens=sum(ds["length"]),
                         loss_tokens=sum(ds["num_loss_tokens"]), max_length=max(ds["length"]),
                         mean_length=sum(ds["length"]) / 3, longest=max(ds["length"]), max_seq_len=1000, policy="drop",
                         records=3, note=None)


def test_long_sequence_policies():
    tok = make_tokenizer()
    recs = records(CONV, CONV[1:3])
    n_long, n_short = (len(tokenize_chat(r["messages"], tok)["input_ids"]) for r in recs)
    ds, s = build_dataset(recs, tok, max_seq_len=n_short)
    assert (s["samples"], s["dropped_too_long"], ds["length"]) == (1, 1, [n_short])
    ds, s = build_dataset(recs, tok, max_seq_len=n_long - 3, policy="truncate")
    assert (s["samples"], s["truncated"], s["max_length"]) == (2, 1, n_long - 3)
    full = tokenize_chat(CONV, tok)
    assert ds[0]["input_ids"] == full["input_ids"][:n_long - 3] and ds[0]["labels"] == full["labels"][:n_long - 3]
    # truncated before the first assistant token: nothing left to learn, so dropped (as too long)
    first_label = next(i for i, l in enumerate(full["labels"]) if l != -100)
    tiny = records(CONV, [msg("user", "hi"), msg("assistant", "yo")])
    assert len(tokenize_chat(tiny[1]["messages"], tok)["input_ids"]) <= first_label
    _, s = build_dataset(tiny, tok, max_seq_len=first_label, policy="truncate")
    assert (s["samples"], s["dropped_too_long"], s["truncated"]) == (1, 1, 0)
    with pytest.raises(DataError) as ei:
        build_dataset(recs, tok, max_seq_len=n_short, policy="error")
    assert (ei.value.path, ei.value.line) == ("data/t.jsonl", 1)
    assert f"data/t.jsonl, line 1: sample is {n_long} tokens long, more than max_seq_len={n_short}" in str(ei.value)
    with pytest.raises(ValueError, match="policy"):
        build_dataset(recs, tok, 100, policy="cut")


def test_samples_without_loss_tokens_are_dropped():
    # this template writes no system text, so the first answer's only label is at position 0: never predicted
    tok = make_tokenizer(chat_template="{% for m in messages %}{% if m['role'] != 'system' %}{{ m['content'] }}{% endif %}{% endfor %}")
    recs = records([msg("system", "s"), msg("assistant", "A")], [msg("user", "What is"), msg("assistant", " Paris")])
    ds, s = build_dataset(recs, tok, 100)
    assert (s["samples"], s["dropped_no_loss"]) == (1, 1) and ds[0]["num_loss_tokens"] > 0
    with pytest.raises(DataError, match="no trainable sample left out of 1: 0 longer .* 1 without any assistant token"):
        build_dataset(recs[:1], tok, 100)


def test_cache_dir_reuses_arrow_files(tmp_path):
    tok = make_tokenizer()
    recs = records(CONV, CONV[1:3])
    ds1, s1 = build_dataset(recs, tok, 1000, cache_dir=tmp_path / "cache")
    files = sorted(p.name for p in (tmp_path / "cache").glob("*.arrow"))
    assert files and all(f["filename"].startswith(str(tmp_path / "cache")) for f in ds1.cache_files)
    mtimes = {p: p.stat().st_mtime_ns for p in (tmp_path / "cache").glob("*.arrow")}
    ds2, s2 = build_dataset(recs, make_tokenizer(), 1000, cache_dir=tmp_path / "cache")
    assert ds2[:] == ds1[:] and s2 == s1
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "cache").glob("*.arrow")} == mtimes   # read, not rewritten
    build_dataset(recs, tok, 999, cache_dir=tmp_path / "cache")                               # other settings: other file
    assert len(list((tmp_path / "cache").glob("*.arrow"))) > len(files)


# ---------------------------------------------------------------- split_records

def test_split_records_is_deterministic_and_complete():
    recs = [{"messages": [], "source": f"f:{i}"} for i in range(50)]
    tr, ev = split_records(recs, 0.2, seed=3)
    assert len(ev) == 10 and len(tr) == 40
    assert split_records(recs, 0.2, seed=3) == (tr, ev) and split_records(recs, 0.2, seed=4)[1] != ev
    assert sorted(r["source"] for r in tr + ev) == sorted(r["source"] for r in recs)
    assert tr == sorted(tr, key=recs.index) and ev == sorted(ev, key=recs.index)
    assert split_records(recs[:3], 0.01, seed=0)[1].__len__() == 1
    assert split_records(recs, 0.0, 1) == (recs, [])
    with pytest.raises(DataError, match="cannot hold out"):
        split_records(recs[:1], 0.5, 0)
    with pytest.raises(ValueError):
        split_records(recs, 1.0, 0)


# ---------------------------------------------------------------- load_tokenizer

def test_load_tokenizer_local_dir_and_pad(tmp_path):
    make_tokenizer(pad_token=None).save_pretrained(tmp_path / "m")
    tok = load_tokenizer(tmp_path / "m")
    assert tok.is_fast and tok.pad_token == "<eos>" and tok.pad_token_id == tok.eos_token_id
    make_tokenizer().save_pretrained(tmp_path / "m2")
    assert load_tokenizer(str(tmp_path / "m2")).pad_token == "<pad>"


def test_load_tokenizer_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        load_tokenizer(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        load_tokenizer("./models/tiny")
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(NotADirectoryError):
        load_tokenizer(tmp_path / "f.txt")
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(OSError, match="could not load a tokenizer from"):
        load_tokenizer(tmp_path / "emptydir")
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)   # never touch the network in tests
    monkeypatch.chdir(tmp_path)
    with pytest.raises(OSError, match="hub ids need network access.*pass its local directory"):
        load_tokenizer("some-org/some-model")


# ---------------------------------------------------------------- issue 7: data from memory and common formats

QA = [{"messages": [msg("user", f"What is {i}+{i}?"), msg("assistant", str(2 * i))]} for i in range(30)]


def test_data_in_memory_names_the_row_as_python_indexes_it():
    df = pd.DataFrame([{"instruction": "Add.", "input": f"{i} {i}", "output": str(2 * i)} for i in range(30)])
    df.loc[17, "output"] = None                                       # pandas: a missing value
    with pytest.raises(DataError) as ei:
        load_chat_records(df)
    assert str(ei.value) == "row 17 of the DataFrame: 'output' is missing (null)"
    rows = [dict(r) for r in QA]
    rows[3] = {"messages": [msg("user", "hi"), msg("bot", "yo")]}
    with pytest.raises(DataError, match=r"^row 3 of the list: message 2 has unknown role 'bot'"):
        load_chat_records(rows)
    ds = datasets.Dataset.from_list(QA)
    recs = load_chat_records(ds)
    assert len(recs) == 30 and recs[5]["messages"] == QA[5]["messages"] and recs[5]["source"] == "the Dataset:5"
    with pytest.raises(DataError, match=r"^the Dataset: has columns \['body'\], which fit none of the accepted shapes"):
        load_chat_records(datasets.Dataset.from_list([{"body": "x"}] * 2400))
    with pytest.raises(DataError, match=r"^the DataFrame: no records \(it is empty\)"):
        load_chat_records(pd.DataFrame({"messages": []}))


def test_every_row_wrong_gives_a_handful_of_lines_and_a_count():
    rows = [{"messages": [msg("user", "q")]} for _ in range(2400)]   # no assistant message anywhere
    with pytest.raises(DataError) as ei:
        load_chat_records(datasets.Dataset.from_list(rows))
    e, lines = ei.value, str(ei.value).splitlines()
    assert e.count == 2400 and len(e.errors) == MAX_DATA_ERRORS == 5 and len(lines) == 6
    assert lines[1] == "... and 2,399 more problems (4 shown):" and lines[-1] == "  row 4 of the Dataset: no assistant message: there is nothing to train on"
    with pytest.raises(DataError) as ei:                             # unknown shape, row by row: shapes named once
        load_chat_records([{"prompt": "q", "completion": "a"}] * 2400)
    assert str(ei.value).count("Accepted rows:") == 1 and str(ei.value).endswith(SHAPES) and len(str(ei.value)) < len(SHAPES) + 500
    with pytest.raises(ConfigError) as ei:                           # a wrong type is one line too
        TrainConfig(model="m", data=list(range(2400)))
    assert len(str(ei.value).splitlines()) == 2 and "item 0 of the list is int" in str(ei.value)
    e2 = pickle.loads(pickle.dumps(e))
    assert str(e2) == str(e) and e2.count == 2400


def test_sharegpt_and_alpaca_rows_become_messages(tmp_path):
    sharegpt = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                                  {"from": "gpt", "value": "Hello"}, {"from": "human", "value": "Bye"},
                                  {"from": "gpt", "value": "Bye!"}]}
    alpaca = [{"instruction": "Translate.", "input": "chat", "output": "cat"}, {"instruction": "Say yes.", "output": "yes"},
              {"instruction": "Say no.", "input": "", "output": "no"}]
    f = write_jsonl(tmp_path / "mixed.jsonl", [sharegpt, *alpaca])
    recs = load_chat_records(f)
    assert recs[0]["messages"] == [msg("system", "Be brief."), msg("user", "Hi"), msg("assistant", "Hello"),
                                   msg("user", "Bye"), msg("assistant", "Bye!")]
    assert [r["messages"][0]["content"] for r in recs[1:]] == ["Translate.\n\nchat", "Say yes.", "Say no."]
    assert all(r["messages"][1]["role"] == "assistant" for r in recs[1:])
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"conversations": [{"from": "human", "value": "q"}, {"from": "bing", "value": "a"}]},
                                               {"instruction": "x"}])
    with pytest.raises(DataError) as ei:
        load_chat_records(bad)
    assert str(ei.value).splitlines() == [
        f"{bad}, line 1: conversation turn 2 has unknown 'from' 'bing' (expected human, gpt or system)",
        "... and 1 more problem:", f"  {bad}, line 2: 'output' is missing"]


def test_json_arrays_parquet_directories_and_globs(tmp_path):
    (tmp_path / "arr.json").write_text(json.dumps(QA[:3], indent=2))
    recs = load_chat_records(tmp_path / "arr.json")
    starts = [i + 1 for i, l in enumerate((tmp_path / "arr.json").read_text().splitlines()) if l == "  {"]
    assert [r["source"] for r in recs] == [f"{tmp_path / 'arr.json'}:{n}" for n in starts]
    (tmp_path / "bad.json").write_text('[\n {"input": "q", "output": "a"},\n {"input": "q"}\n]')
    with pytest.raises(DataError, match=r"bad\.json, line 3: 'output' is missing"):
        load_chat_records(tmp_path / "bad.json")
    pd.DataFrame([{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": str(i)}]} for i in range(7)]
                 ).to_parquet(tmp_path / "sg.parquet")
    assert [r["messages"][1]["content"] for r in load_chat_records(tmp_path / "sg.parquet")] == [str(i) for i in range(7)]
    (tmp_path / "sg.parquet").rename(tmp_path / "parquet.jsonl")       # recognised by content, not by name
    assert len(load_chat_records(tmp_path / "parquet.jsonl")) == 7
    pd.DataFrame({"body": ["x"]}).to_parquet(tmp_path / "text.parquet")
    with pytest.raises(DataError, match=r"text\.parquet: has columns \['body'\], which fit none"):
        load_chat_records(tmp_path / "text.parquet")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match=r"broken\.parquet: is not a readable Parquet file"):
        load_chat_records(tmp_path / "broken.parquet")
    shards = tmp_path / "shards"
    shards.mkdir()
    for k in range(3):
        write_jsonl(shards / f"part-{k}.jsonl", QA[10 * k:10 * k + 10])
    (shards / "README.md").write_text("not data")
    assert len(load_chat_records(shards)) == 30
    assert [r["source"] for r in load_chat_records(str(shards / "part-[12].jsonl"))][::10] == [
        f"{shards / 'part-1.jsonl'}:1", f"{shards / 'part-2.jsonl'}:1"]
    assert len(load_chat_records(str(tmp_path / "**" / "*.jsonl"))) == 30 + 7
    with pytest.raises(DataError, match=r"\*\.csv: no file matches this pattern"):
        load_chat_records(str(tmp_path / "*.csv"))
    (tmp_path / "nothing").mkdir()
    with pytest.raises(DataError, match=r"nothing: is a directory without \.jsonl, \.json or \.parquet files"):
        load_chat_records(tmp_path / "nothing")


def test_config_keeps_data_in_memory_and_refuses_to_write_it(tmp_path):
    df = pd.DataFrame(QA)
    cfg = TrainConfig(model="m", data=df, eval_data=QA[:2])
    assert isinstance(cfg.data[0], InMemoryData) and cfg.data[0].obj is df and cfg.eval_data[0].name == "the eval_data list"
    assert cfg.resolved(tmp_path).data[0].obj is df
    with pytest.raises(ValueError, match="the DataFrame is held in memory"):
        cfg.to_json(tmp_path / "c.json")
    with pytest.raises(ConfigError, match=r"DatasetDict with splits \['train'\]"):
        TrainConfig(model="m", data=datasets.DatasetDict(train=datasets.Dataset.from_list(QA)))
    out = write_chat_jsonl(load_chat_records(df), tmp_path / "data" / "train.jsonl")
    assert [r["messages"] for r in load_chat_records(out)] == [r["messages"] for r in QA]
    assert sorted(p.name for p in out.parent.iterdir()) == ["train.jsonl"]


def test_long_samples_are_said_once_and_the_tokenizer_warning_is_gone():
    tok = make_tokenizer()
    tok.model_max_length = 16
    seen = []
    handler = logging.Handler()
    handler.emit = lambda r: seen.append(r.getMessage())
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        tok(tok.apply_chat_template(CONV, tokenize=False, chat_template=DEFAULT_CHAT_TEMPLATE))   # the warning this replaces
        assert any("Token indices sequence length" in m for m in seen), seen
        seen.clear()
        recs = [{"messages": CONV, "source": "f:1"}, {"messages": CONV[1:3], "source": "f:2"}]
        full = len(tokenize_chat(CONV, tok)["input_ids"])
        _, stats = build_dataset(recs, tok, max_seq_len=full - 1)
    finally:
        logger.removeHandler(handler)
    assert not any("Token indices sequence length" in m for m in seen), seen
    assert stats["longest"] == full and stats["dropped_too_long"] == 1
    assert stats["note"].startswith(f"1 sample of 2 was longer than max_seq_len={full - 1} tokens and dropped "
                                    f"(the longest has {full} tokens)")
    assert "more than the tokenizer's model_max_length=16" in stats["note"]
    assert length_note({**stats, "dropped_too_long": 0, "max_length": 10}) is None


def test_construction_with_bad_rows_in_memory_writes_nothing(demo, runs_root):
    from ilab_nb.session import FineTuneSession
    df = pd.DataFrame(QA)
    df.at[17, "messages"] = [msg("user", "only a question")]
    with pytest.raises(DataError, match=r"^row 17 of the DataFrame: no assistant message"):
        FineTuneSession(demo.model_dir, df, runs_root=runs_root, num_processes=1, strategy="single", device="cpu")
    assert not runs_root.exists()


@pytest.mark.processes
def test_a_run_from_a_dataframe_end_to_end(tracked_run):
    "conftest's `tracked_run` trains from a DataFrame (small_train's rows and one over-long row), eval_data a list."
    from conftest import EVAL_ROWS, TRAIN_LINES
    s = tracked_run
    cfg = json.loads((s.run_dir / "config.json").read_text())
    assert cfg["data"] == [str(s.run_dir / "data" / "train.jsonl")] and cfg["eval_data"] == [str(s.run_dir / "data" / "eval.jsonl")]
    assert len((s.run_dir / "data" / "train.jsonl").read_text().splitlines()) == TRAIN_LINES + 1
    assert len((s.run_dir / "data" / "eval.jsonl").read_text().splitlines()) == EVAL_ROWS
    s.monitor.poll()
    stats = s.monitor.header["data_stats"]["train"]
    note, dropped = stats["note"], stats["dropped_too_long"]
    assert dropped == 1 and note.startswith(f"1 sample of {TRAIN_LINES + 1} was longer than max_seq_len=256 tokens and dropped"), note
    log = (s.run_dir / "logs" / "rank-0.log").read_text()
    assert f"training data: {note}" in log and "Token indices sequence length" not in log


def test_messages_never_contradict_themselves():
    "Issue 20 item 4: an empty Dataset is empty (was: 'has columns []'); a missing value is missing (was: 'unknown shape (keys: 'text')')."
    from ilab_nb.config import TrainConfig
    from ilab_nb.data import load_records
    for data, said in [(datasets.Dataset.from_dict({}), "the Dataset: is empty: it has no columns and no rows"),
                       (pd.DataFrame(), "the DataFrame: is empty: it has no columns and no rows"),
                       (pd.DataFrame([{"text": "a"}, {"text": None}]), "row 1 of the DataFrame: 'text' is missing (null)"),
                       ([{"prompt": "q", "chosen": [], "rejected": "b"}], "'chosen' must be a non-empty string or list of messages, got an empty array"),
                       ([{"messages": []}], "objects, got an empty array"),
                       ([{"input": "q", "output": 5}], "'output' must be a string, got a number")]:
        with pytest.raises(DataError) as ei: load_records(TrainConfig(model="m", data=data).data)
        assert said in str(ei.value) and "has columns []" not in str(ei.value), str(ei.value)


def test_rows_with_images_are_checked_where_they_lie_and_refused_for_a_text_model(demo, runs_root, tmp_path):
    """Chat rows with images in TRL's format: each image is opened where the data file says (relative to it), and a
    missing or corrupt one, or a count of images that differs from the placeholders, is named with its file, line and
    image. Valid rows for a text model are then refused by the session before anything is written: its images must
    not be dropped silently."""
    from PIL import Image
    from ilab_nb.session import FineTuneSession
    (tmp_path / "img").mkdir()
    Image.new("RGB", (8, 8), "red").save(tmp_path / "img" / "red.png")
    Image.effect_noise((32, 32), 60).save(tmp_path / "img" / "noise.png")
    (tmp_path / "img" / "cut.png").write_bytes((tmp_path / "img" / "noise.png").read_bytes()[:500])
    q = [msg("user", "What colour is it?"), msg("assistant", "red")]
    parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}, msg("assistant", "red")]
    rows = [{"messages": q, "images": ["img/red.png"]}, {"messages": q, "image": "img/blue.png"},
            {"messages": q, "images": ["img/cut.png"]}, {"messages": parts, "images": ["img/red.png", "img/red.png"]},
            {"messages": q, "video": "clip.mp4"}]
    f = tmp_path / "vqa.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError) as e:
        load_records(str(f))
    texts = [p["text"] for p in e.value.errors]
    assert texts[0] == f"{f}, line 2: image 1 'img/blue.png' not found (relative to {tmp_path})"
    assert texts[1].startswith(f"{f}, line 3: image 1 'img/cut.png' is not a readable image (OSError: "), texts[1]
    assert texts[2:] == [f'{f}, line 4: has 2 image(s) but 1 {{"type": "image"}} placeholder(s) for them',
                         f"{f}, line 5: has a 'video' column: ilab_nb trains on text and images, not on video or audio"]

    f.write_text(json.dumps(rows[0]) + "\n" + json.dumps({"messages": q}) + "\n")
    (rec, text_only) = load_records(str(f))
    assert rec["images"] == [str(tmp_path / "img" / "red.png")] and "images" not in text_only
    assert rec["messages"][0]["content"] == [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]
    with pytest.raises(DataError, match=rf"^{f}, line 1: has images, but {demo.model_dir} is a text model: give a "
                                        r"vision-language model"):
        FineTuneSession(demo.model_dir, str(f), runs_root=runs_root, num_processes=1, strategy="single", device="cpu")
    assert not runs_root.exists()
