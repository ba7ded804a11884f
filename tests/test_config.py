"""Behaviour of ilab_nb.config: validation rules, error messages, loading and saving."""
import json
import pickle

import pytest

from ilab_nb.config import ConfigError, TrainConfig, load_config

BASE = dict(model="tiny", data="train.jsonl")


def problems(**kw):
    with pytest.raises(ConfigError) as ei:
        TrainConfig.from_kwargs(**{**BASE, **kw})
    return ei.value


def test_defaults_and_coercion():
    cfg = TrainConfig.from_kwargs(**BASE)
    assert cfg.data == ["train.jsonl"]
    assert (cfg.num_processes, cfg.strategy, cfg.device, cfg.precision) == (2, "fsdp", "auto", "fp32")
    assert (cfg.max_steps, cfg.num_train_epochs, cfg.max_tokens_per_batch, cfg.max_seq_len) == (-1, 1.0, 4096, 2048)
    assert cfg.eval_data is None and cfg.save_steps is None and cfg.launcher_args == []
    assert TrainConfig.from_kwargs(**BASE, eval_data="e.jsonl").eval_data == ["e.jsonl"]
    assert TrainConfig.from_kwargs(**BASE, launcher_args="--mixed_precision no").launcher_args == ["--mixed_precision", "no"]
    for name, f in TrainConfig.model_fields.items():
        assert f.description, name


def test_unknown_field_names_closest():
    e = problems(learning_rat=1e-4)
    assert "unknown field 'learning_rat' — did you mean 'learning_rate'?" in str(e)
    assert e.errors[0]["field"] == "learning_rat" and e.errors[0]["type"] == "unknown_field"
    e = problems(zzzz=1)
    assert "unknown field 'zzzz'" in str(e) and "valid fields:" in str(e)


def test_direct_constructor_and_dict_raise_config_error():
    with pytest.raises(ConfigError, match="model: required field is missing"):
        TrainConfig(data="x")
    with pytest.raises(ConfigError, match="in my-source"):
        TrainConfig.from_dict({"model": "m", "data": []}, source="my-source")
    with pytest.raises(ConfigError, match="must be a mapping"):
        TrainConfig.from_dict(["model"])


@pytest.mark.parametrize("kw, field, text", [
    (dict(num_processes=0), "num_processes", "greater than or equal to 1"),
    (dict(eval_split=1.0), "eval_split", "less than 1"),
    (dict(eval_steps=0), "eval_steps", "greater than or equal to 1"),
    (dict(max_steps=0), "max_steps", "-1"),
    (dict(max_steps=-2), "max_steps", "-1"),
    (dict(learning_rate=0), "learning_rate", "greater than 0"),
    (dict(warmup_ratio=1.0), "warmup_ratio", "less than 1"),
    (dict(adam_beta2=1.0), "adam_beta2", "less than 1"),
    (dict(adam_epsilon=0), "adam_epsilon", "greater than 0"),
    (dict(max_grad_norm=-1), "max_grad_norm", "greater than or equal to 0"),
    (dict(max_tokens_per_batch=8), "max_tokens_per_batch", "16"),
    (dict(max_seq_len=1), "max_seq_len", "2"),
    (dict(devices=[0, 0], num_processes=2), "devices", "distinct"),
    (dict(devices=[-1, 0]), "devices", ">= 0"),
    (dict(strategy="zero"), "strategy", "'fsdp', 'ddp' or 'single'"),
    (dict(precision="fp16"), "precision", "'fp32' or 'bf16'"),
    (dict(long_sequence_policy="cut"), "long_sequence_policy", "drop"),
    (dict(accelerate_config="does/not/exist.yaml"), "accelerate_config", "file not found"),
    (dict(data=[]), "data", "at least 1"),
])
def test_field_rules(kw, field, text):
    e = problems(**kw)
    assert [p["field"] for p in e.errors] == [field]
    assert f"{field}: " in str(e) and text in str(e)


@pytest.mark.parametrize("kw, field, text", [
    (dict(eval_data="e.jsonl", eval_split=0.1), "eval_split", "not both"),
    (dict(eval_steps=10), "eval_steps", "no eval data"),
    (dict(strategy="single"), "strategy", "num_processes is 2"),
    (dict(strategy="ddp", num_processes=1), "strategy", "num_processes >= 2"),
    (dict(devices=[0, 1, 2]), "devices", "one per process"),
    (dict(devices=[0, 1], device="cpu"), "devices", "'cpu'"),
    (dict(warmup_steps=5, warmup_ratio=0.1), "warmup_ratio", "not both"),
    (dict(warmup_steps=5, lr_scheduler_type="constant"), "lr_scheduler_type", "constant_with_warmup"),
    (dict(max_seq_len=8192), "max_seq_len", "max_seq_len (8192) must be <= max_tokens_per_batch (4096)"),
])
def test_cross_field_rules(kw, field, text):
    e = problems(**kw)
    assert [p["field"] for p in e.errors] == [field]
    assert text in str(e)


def test_valid_combinations():
    TrainConfig.from_kwargs(**BASE, strategy="fsdp", num_processes=1)
    TrainConfig.from_kwargs(**BASE, strategy="single", num_processes=1)
    TrainConfig.from_kwargs(**BASE, devices=[3, 1], device="cuda", eval_split=0.2, eval_steps=5)
    TrainConfig.from_kwargs(**BASE, warmup_steps=5, lr_scheduler_type="constant_with_warmup", max_steps=10)


def test_all_cross_field_problems_reported_together():
    e = problems(strategy="single", warmup_steps=1, warmup_ratio=0.5, max_seq_len=5000)
    assert [p["field"] for p in e.errors] == ["strategy", "warmup_ratio", "max_seq_len"]
    assert "3 problems" in str(e)


def test_assignment_validated_and_rolled_back():
    cfg = TrainConfig.from_kwargs(**BASE)
    with pytest.raises(ConfigError, match="learning_rate"):
        cfg.learning_rate = -1
    with pytest.raises(ConfigError, match="max_tokens_per_batch"):
        cfg.max_seq_len = 5000
    assert cfg.max_seq_len == 2048 and cfg.learning_rate == 2e-5
    cfg.max_seq_len = 100
    assert cfg.max_seq_len == 100


def test_from_file_yaml_json_and_overrides(tmp_path):
    (tmp_path / "c.yaml").write_text("model: tiny\ndata: a.jsonl\nmax_steps: 7\n")
    (tmp_path / "c.json").write_text(json.dumps({"model": "tiny", "data": ["a.jsonl"], "seed": 3}))
    assert TrainConfig.from_file(tmp_path / "c.yaml").max_steps == 7
    assert TrainConfig.from_file(tmp_path / "c.yaml", max_steps=2).max_steps == 2
    assert TrainConfig.from_file(str(tmp_path / "c.json")).seed == 3


def test_from_file_errors_name_file_and_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model: tiny\ndata: a.jsonl\nnum_train_epoch: 3\n")
    with pytest.raises(ConfigError) as ei:
        TrainConfig.from_file(p)
    msg = str(ei.value)
    assert str(p) in msg and "did you mean 'num_train_epochs'?" in msg and "(line 3)" in msg

    p.write_text("model: tiny\ndata: [a.jsonl\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml, line \d+, column \d+: invalid YAML"):
        TrainConfig.from_file(p)
    j = tmp_path / "bad.json"
    j.write_text('{"model": "tiny",\n "data": }')
    with pytest.raises(ConfigError, match=r"bad\.json, line 2, column \d+: invalid JSON"):
        TrainConfig.from_file(j)
    p.write_text("- model\n- tiny\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        TrainConfig.from_file(p)
    with pytest.raises(ConfigError, match="config file not found"):
        TrainConfig.from_file(tmp_path / "nope.yaml")
    (tmp_path / "c.toml").write_text("")
    with pytest.raises(ConfigError, match="unknown config file type"):
        TrainConfig.from_file(tmp_path / "c.toml")


def test_json_round_trip(tmp_path):
    cfg = TrainConfig.from_kwargs(**BASE, eval_split=0.25, devices=[1, 0], device="cuda", launcher_args=["--x"])
    cfg.to_json(tmp_path / "config.json")
    text = (tmp_path / "config.json").read_text()
    assert json.loads(text) == cfg.model_dump(mode="json") and '\n  "model"' in text
    assert TrainConfig.read_json(tmp_path / "config.json") == cfg


def test_resolved_makes_existing_local_paths_absolute(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "t.jsonl").write_text("")
    (tmp_path / "acc.yaml").write_text("{}")
    (tmp_path / "models" / "m").mkdir(parents=True)
    cfg = TrainConfig.from_kwargs(model="models/m", data=["data/t.jsonl", "missing.jsonl"], eval_data="data/t.jsonl")
    r = cfg.resolved(tmp_path)
    assert r.model == str(tmp_path / "models" / "m")
    assert r.data == [str(tmp_path / "data" / "t.jsonl"), "missing.jsonl"]
    assert r.eval_data == [str(tmp_path / "data" / "t.jsonl")]
    assert cfg.model == "models/m"                       # the original is unchanged
    assert TrainConfig.from_kwargs(model="org/name", data="x").resolved(tmp_path).model == "org/name"


def test_load_config_accepts_config_dict_and_path(tmp_path):
    base = TrainConfig.from_kwargs(**BASE)
    c = load_config(base, seed=7)
    assert c.seed == 7 and base.seed == 42 and c is not base
    assert load_config(dict(BASE), max_steps=3).max_steps == 3
    (tmp_path / "c.yml").write_text("model: tiny\ndata: a.jsonl\n")
    assert load_config(tmp_path / "c.yml", num_processes=1).num_processes == 1
    with pytest.raises(ConfigError, match="learning_rate"):
        load_config(base, learning_rate=0)
    with pytest.raises(ConfigError, match="cannot make a config from int"):
        load_config(3)


def test_config_error_is_value_error_and_pickles():
    e = problems(seed="x", lerning_rate=1)
    assert isinstance(e, ValueError)
    e2 = pickle.loads(pickle.dumps(e))
    assert str(e2) == str(e) and e2.errors == e.errors
