"""Hostile and bad input, one case at a time, through what a user calls (the session, the command line, real files and
processes): a run directory cannot reach outside itself, another user's run is not acted on unless its owner is
trusted, and no bad value trains. The parser-level forms of the same rules are checked in the notebooks (12_config,
11_rundir, 20_data, 60_preflight, 61_session)."""
import json, os, shutil
from pathlib import Path

import pytest

from ilab_nb import FineTuneSession
from ilab_nb.config import ConfigError, TrainConfig
from ilab_nb.data import DataError
from ilab_nb.preflight import PreflightError
from ilab_nb.rundir import OwnerError, RunDirLinkError, RunPaths, State
from ilab_nb.runstore import RunStore

from conftest import FIELDS, cli_env, fork_here, ilab, make_session, runs_env

ONE = {**FIELDS, "num_processes": 1}
ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="gives a run directory to another user (chown): needs root")


def ended_run(root: Path, run_id: str, status=State.failed, **state) -> Path:
    "A run directory as a run that ended leaves it (state, events, logs), without training: what readers act on."
    store = RunStore(root); d = store.create_run(run_id)
    store.write_state(run_id, status=status, attempt=1, num_processes=2, **state)
    store.append_event(run_id, "created")
    RunPaths(d).logs.mkdir(exist_ok=True)
    RunPaths(d).rank_log(1).write_text("step 1/4 loss 3.2\n")
    TrainConfig(model="m", data=["d.jsonl"], num_processes=2).to_json(RunPaths(d).config)
    return d


# --- the run directory is a boundary ---------------------------------------------------------------------------------

@pytest.mark.processes
def test_logs_never_print_what_a_link_points_at_nor_nothing_for_a_missing_rank(tmp_path):
    "`ilab-nb logs` of a log linked to a file elsewhere refuses (that file's text is not printed); --rank 7 of a 2-rank run says so."
    secret = tmp_path / "elsewhere" / "secret.txt"; secret.parent.mkdir(); secret.write_text("the other file's text\n")
    d = ended_run(tmp_path / "runs", "r-linked")
    RunPaths(d).rank_log(0).symlink_to(secret)
    r = ilab("logs", "r-linked", "--rank", "0", "--runs-root", tmp_path / "runs", check=2)
    assert "the other file's text" not in r.stdout + r.stderr
    assert f"rank-0.log is a symbolic link (to {secret}); ilab_nb does not follow links in a run directory" in r.stderr
    r = ilab("logs", "r-linked", "--rank", "7", "--runs-root", tmp_path / "runs", check=2)
    assert "run r-linked has 2 rank(s), 0..1: there is no rank 7" in r.stderr and not r.stdout


def test_nothing_of_a_run_with_a_link_is_resumed_forked_or_launched(tmp_path):
    """A run whose log is linked out (the resumed worker would have appended to that file) and one whose checkpoint
    holds a linked folder (a fork would have hard-linked its files): refused before anything is written or started;
    the files elsewhere keep their one link and their bytes."""
    from ilab_nb.launcher import spawn_supervisor
    elsewhere = tmp_path / "elsewhere"; elsewhere.mkdir(); (elsewhere / "weights.bin").write_bytes(b"not the run's")
    out_log = elsewhere / "my.log"; out_log.write_text("mine\n")
    d = ended_run(tmp_path / "runs", "r-log", status=State.cancelled)
    RunPaths(d).rank_log(0).symlink_to(out_log)
    e = ended_run(tmp_path / "runs", "r-ckpt", status=State.cancelled)
    ck = RunPaths(e).checkpoint(2); ck.mkdir(parents=True); (ck / "COMPLETE").write_text("{}")
    (ck / "extra").symlink_to(elsewhere, target_is_directory=True)
    before = {p.name: (p.read_bytes(), p.stat().st_nlink) for p in elsewhere.iterdir()}
    for run_id, doing in (("r-log", lambda s: s.resume()), ("r-ckpt", lambda s: s.resume()), ("r-ckpt", lambda s: s.fork(2))):
        s = FineTuneSession.attach(run_id, runs_root=tmp_path / "runs")
        with pytest.raises(RunDirLinkError, match="ilab_nb does not follow links in a run directory, so it will not"):
            doing(s)
        assert s.status == State.cancelled
    with pytest.raises(RunDirLinkError, match="so it will not start its processes"):
        spawn_supervisor(d, attempt=2)                                   # a link made after the resume's own check
    assert sorted(RunStore(tmp_path / "runs").list_runs()) == ["r-ckpt", "r-log"]
    assert {p.name: (p.read_bytes(), p.stat().st_nlink) for p in elsewhere.iterdir()} == before


@needs_root
@pytest.mark.processes
def test_root_does_not_resume_another_users_run_nor_run_its_code(demo, tmp_path):
    """A run directory given to another user whose config points `model` at a folder with its own code and
    `trust_remote_code: true`: resuming or forking it as root is refused naming the owner, and so is using its
    config; the model's code never runs (it would leave a file). With trust_owner=True the caller takes it on."""
    model = tmp_path / "their-model"; shutil.copytree(demo.model_dir, model)
    ran = tmp_path / "the-code-ran"
    (model / "configuration_theirs.py").write_text(f"open({str(ran)!r}, 'w').write('x')\n")    # what importing it does
    mc = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**mc, "auto_map": {"AutoConfig": "configuration_theirs.TheirConfig"}}))
    d = ended_run(tmp_path / "runs", "r-theirs", status=State.cancelled)
    cfg = make_session(demo, demo.train_file, tmp_path / "mine", num_processes=1).config.model_copy(
        update=dict(model=str(model), trust_remote_code=True))
    cfg.to_json(RunPaths(d).config)
    for p in [d, *d.rglob("*"), model, *model.rglob("*")]: os.chown(p, 65534, 65534, follow_symlinks=False)
    s = FineTuneSession.attach("r-theirs", runs_root=tmp_path / "runs")
    assert s.status == State.cancelled                                          # reading it needs no trust
    with pytest.raises(OwnerError, match="r-theirs is owned by nobody \\(uid 65534\\), not by you .*will not resume it unless you "
                                         "trust its owner \\(trust_owner=True; ilab-nb: --trust-owner\\)"):
        s.resume()
    with pytest.raises(OwnerError, match="config.json is owned by nobody .* will not use it as a config"):
        FineTuneSession(config=RunPaths(d).config, runs_root=tmp_path / "mine")
    r = ilab("resume", "r-theirs", "--runs-root", tmp_path / "runs", check=2)
    assert "is owned by nobody (uid 65534)" in r.stderr
    # a config of one's own that points at their model with trust_remote_code: the code is named and refused, unrun
    mine = tmp_path / "mine.json"; mine.write_text(RunPaths(d).config.read_text())
    with pytest.raises(PreflightError, match="trust_remote_code: .*their-model is owned by nobody .* will not run its code"):
        FineTuneSession(config=mine, runs_root=tmp_path / "mine")
    assert not ran.exists() and s.status == State.cancelled and not (tmp_path / "mine").exists()


# --- values that would train wrong, or fail only after launch --------------------------------------------------------

def test_config_file_errors_name_the_key_and_its_line_before_anything_runs(demo, small_train, tmp_path, capsys):
    """A key given twice, lora.layers_to_transform without a list of targets (peft refused it after launch), and one
    naming a layer the model lacks (known only from the model): refused with the line, the last by `ilab-nb run`
    (its `main`, called here: a process of its own imported torch and transformers again, ~5 CPU-s)."""
    base = f"model: {demo.model_dir}\ndata: {small_train}\nnum_processes: 1\ndevice: cpu\n"
    (tmp_path / "twice.yaml").write_text(base + "learning_rate: 1e-4\nmax_steps: 4\nlearning_rate: 3e-4\n")
    with pytest.raises(ConfigError, match="twice.yaml, line 7: 'learning_rate' is given twice \\(first on line 5\\); only one would be used"):
        FineTuneSession(config=tmp_path / "twice.yaml", runs_root=tmp_path / "runs")
    (tmp_path / "layers.yaml").write_text(base + "lora:\n  r: 4\n  layers_to_transform: [0, 1]\n")
    with pytest.raises(ConfigError, match="lora: layers_to_transform needs target_modules as a list of layer names.*\\(line 7\\)"):
        FineTuneSession(config=tmp_path / "layers.yaml", runs_root=tmp_path / "runs")
    (tmp_path / "q.yaml").write_text(base + "lora:\n  r: 4\nquantization:\n  load_in_4bit: true\n  bnb_4bit_quant_typ: nf4\n")
    with pytest.raises(ConfigError, match="quantization: unknown BitsAndBytesConfig field 'bnb_4bit_quant_typ' — did you mean "
                                          "'bnb_4bit_quant_type'\\? \\(line 9\\)"):     # the key's own line
        FineTuneSession(config=tmp_path / "q.yaml", runs_root=tmp_path / "runs")
    (tmp_path / "layers9.yaml").write_text(base + "lora:\n  r: 4\n  target_modules: [q_proj]\n  layers_to_transform: [9]\n")
    from ilab_nb.cli import main
    assert main(["run", str(tmp_path / "layers9.yaml"), "--runs-root", str(tmp_path / "runs")]) == 2
    assert ("lora.layers_to_transform: LlamaForCausalLM has layers 0..3; [9] are not among them "
            f"({tmp_path / 'layers9.yaml'}, line 8)") in capsys.readouterr().err
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())


@pytest.mark.parametrize("case", ["lm_head tied", "targets nothing", "r=1e9", "too long", "no pair left", "beta=inf",
                                  "moved model", "latin-1 txt", "txt beside jsonl"])
def test_bad_values_are_refused_at_construction_with_the_field(case, demo, small_train, tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(Path(demo.pref_train_file).read_text().splitlines(keepends=True)[:20]))
    docs = tmp_path / "docs"; docs.mkdir(); (docs / "a.txt").write_bytes("Caf\xe9 au lait.\n".encode("latin-1"))
    mixed = tmp_path / "mixed"; mixed.mkdir(); shutil.copy(small_train, mixed / "chat.jsonl"); (mixed / "notes.txt").write_text("x")
    kw, exc, said = {
        "lm_head tied": (dict(lora=dict(r=4, target_modules=["q_proj", "lm_head"])), PreflightError,
                         "lora.target_modules adapts lm_head, whose weight is tied to the input embedding"),
        "targets nothing": (dict(lora=dict(r=4, target_modules=["qkv"])), PreflightError,
                            "lora.target_modules=['qkv'] matches no layer of LlamaForCausalLM; its linear layers are down_proj"),
        "r=1e9": (dict(lora=dict(r=10**9)), PreflightError, "lora.r=1000000000 is more than any linear layer of LlamaForCausalLM"),
        "too long": (dict(max_seq_len=24, long_sequence_policy="error"), PreflightError, "line 1: sample is"),
        "no pair left": (dict(data=pairs, method="dpo", max_seq_len=20), PreflightError, "no pair left out of 20: 20 too long"),
        "beta=inf": (dict(data=pairs, method="dpo", beta=float("inf")), ConfigError, "beta: Input should be a finite number"),
        "moved model": (dict(model=tmp_path / "moved-away"), PreflightError, "moved-away' does not exist (a folder moved or deleted?)"),
        "latin-1 txt": (dict(data=docs), DataError, "a.txt, line 1: not valid UTF-8 text (invalid continuation byte at byte 3)"),
        "txt beside jsonl": (dict(data=mixed), DataError, "holds both data files (chat.jsonl, ...) and .txt documents (notes.txt, ...)"),
    }[case]
    runs = tmp_path / "runs"
    with pytest.raises(exc) as e: FineTuneSession(kw.pop("model", demo.model_dir), kw.pop("data", small_train), runs_root=runs, **{**ONE, **kw})
    assert said in str(e.value), str(e.value)
    if exc is PreflightError and case != "moved model": assert e.value.field.split(".")[0] in ("lora", "max_seq_len")
    assert not runs.exists()


def test_the_disk_estimate_counts_every_checkpoint_kept_and_lora_ones_by_their_adapters(demo, small_train, tmp_path):
    from ilab_nb.sizes import checkpoint_bytes, tensor_sizes, tokenizer_bytes
    tok = tokenizer_bytes(demo.model_dir)
    full = make_session(demo, small_train, tmp_path / "runs", **ONE, max_steps=10, save_steps=2).preflight
    assert (full["checkpoints_written"], full["checkpoints_kept"]) == (5, 5)
    assert full["checkpoint_bytes"] == checkpoint_bytes(full["params"], len(tensor_sizes(demo.model_dir)), tok, 1)
    kept = make_session(demo, small_train, tmp_path / "runs", **ONE, max_steps=10, save_steps=2, save_total_limit=1).preflight
    assert kept["checkpoints_kept"] == 2                                           # the newest, and the one being written
    lora = make_session(demo, small_train, tmp_path / "runs", **ONE, max_steps=10, save_steps=2, lora=dict(r=4)).preflight
    m = lora["model"]       # 16 bytes a parameter and each adapter tensor's framing: a real one measured in 60_preflight
    assert lora["checkpoint_bytes"] == checkpoint_bytes(m["trainable_params"], m["trainable_tensors"], tok, 1) < full["checkpoint_bytes"] / 10


@pytest.mark.processes
def test_a_huge_learning_rate_fails_the_run_then_resume_starts_it_over_and_a_fork_may_keep_only_adapters(demo, small_train, runs_root):
    """learning_rate=1e30 is a number, so the run starts; its second step is not finite and the run fails there, with
    no checkpoint saved before it. resume() then starts it over from step 0 (with a sane rate), and completes. From its
    checkpoint, a resume on 2 processes must say how it keeps the global batch, and a fork may change merge_lora."""
    s = make_session(demo, small_train, runs_root, **{**ONE, "learning_rate": 1e30}, max_steps=3, lora=dict(r=4))
    s.start()
    assert s.wait(timeout=300) == State.failed
    assert "at step 2: the update was not applied, and the run stops rather than train on it; no checkpoint was saved before it" in s.reason
    s.resume(learning_rate=1e-3)                                     # ConfigError before: 'has no complete checkpoint'
    assert s.wait(timeout=300) == State.completed, s.reason
    train = s.metrics(kinds=("train",))
    assert [(r["attempt"], r["step"]) for r in train] == [(2, 1), (2, 2), (2, 3)]        # the failed attempt's steps replaced
    assert s.state["attempts"][0]["status"] == State.failed and s.state["resumed_from_step"] == 0
    assert [h["resumed_from_step"] for h in s.metrics(kinds=("header",))] == [None, 0]    # attempt 2 started over
    with pytest.raises(ConfigError, match="would change the global batch from 1 to 2 micro-batches per optimizer step"):
        s.resume(max_steps=6, num_processes=2)
    f, outcome = fork_here(s, "3", max_steps=4, merge_lora=False)    # the step as a command line gives it
    assert outcome == State.completed and f.config.merge_lora is False
    final = RunPaths(f.run_dir).final
    assert (final / "adapter" / "adapter_model.safetensors").exists() and not (final / "config.json").exists()


def test_adapters_whose_base_moved_say_so_and_load_onto_it_where_it_is(demo, tmp_path):
    "A LoRA run's final/ holds only adapters (merge_lora=False) and its base folder moved: said, then loaded with base_model=."
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    base = tmp_path / "base"; shutil.copytree(demo.model_dir, base)
    d = ended_run(tmp_path / "runs", "r-lora", status=State.completed)
    pm = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=4, target_modules=["q_proj"]))
    pm.peft_config["default"].base_model_name_or_path = str(base)
    pm.save_pretrained(RunPaths(d).final / "adapter"); AutoTokenizer.from_pretrained(base).save_pretrained(RunPaths(d).final)
    base.rename(tmp_path / "moved")
    s = FineTuneSession.attach("r-lora", runs_root=tmp_path / "runs")
    with pytest.raises(ValueError, match=f"holds LoRA adapters of the base model {base}, which is no longer there .moved or "
                                         "deleted..; put it back, or load them onto it where it is now: load_model.*base_model=PATH"):
        s.load_model()
    model, tok = s.load_model(base_model=str(tmp_path / "moved"))
    assert hasattr(model, "peft_config") and tok.pad_token_id is not None


# --- a model's own code --------------------------------------------------------------------------------------------

def test_a_model_that_needs_its_own_code_is_refused_without_trust_remote_code_and_nothing_asks(demo, tmp_path, monkeypatch, capsys):
    """A model folder whose model_type transformers does not know, built by its own code (auto_map), on a run without
    trust_remote_code: load_model, chat, evaluate and export refuse it naming the field, and so do the export process
    (started with no terminal: it waited at transformers' "Do you wish to run the custom code? [y/N]") and the
    evaluation process's loader; its code never runs. The processes' own code is run here (no process is started)."""
    import re, subprocess
    from ilab_nb.evaluation import load_for_eval
    from ilab_nb.export import main, run_export
    ran = tmp_path / "the-code-ran"
    model = tmp_path / "theirs"; shutil.copytree(demo.model_dir, model)
    (model / "configuration_theirs.py").write_text(f"open({str(ran)!r}, 'w').write('x')\n")        # what importing it does
    mc = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**mc, "model_type": "theirs", "auto_map": {"AutoConfig": "configuration_theirs.TheirConfig"}}))
    ended_run(tmp_path / "runs", "r")
    s = FineTuneSession.attach("r", runs_root=tmp_path / "runs")
    said = (f"{re.escape(str(model))} needs its own Python code to load \\(its model_type 'theirs' is not one transformers "
            "knows; its config.json's auto_map names configuration_theirs.TheirConfig\\) and trust_remote_code is False: ")
    for call, doing in ((lambda: s.load_model(model), "load its model"), (lambda: s.chat(model), "load its model"),
                        (lambda: s.evaluate(["heldout"], checkpoint=model), "evaluate it"),
                        (lambda: s.export(checkpoint=model, dtype="f32", progress=False), "export it")):
        with pytest.raises(ValueError, match=said + "ilab_nb runs a model's own code only when the run's config says "
                                             f"trust_remote_code=True, so it will not {doing}$"):
            call()
    assert main([str(model), str(tmp_path / "out" / "m.gguf")]) == 2          # what the export process runs, here
    assert re.search(said + "pass --trust-remote-code to run it", capsys.readouterr().err)
    started = []
    def popen(*a, **k): started.append(k.get("stdin")); raise OSError("not started here")
    monkeypatch.setattr(subprocess, "Popen", popen)
    with pytest.raises(OSError, match="not started here"): run_export(demo.model_dir, tmp_path / "out" / "m.gguf", "f32", progress=False)
    assert started == [subprocess.DEVNULL]                   # nothing in the export process can ask on a terminal
    with pytest.raises(ValueError, match=said + "the evaluation runs a model's own code only when"):
        load_for_eval(str(model), {"trust_remote_code": False})
    assert not ran.exists() and not list((tmp_path / "out").glob("*.gguf"))


# --- tolerant readers: one bad file of one run is said where the run is shown, never raised into a reader --------------
# (run directories built by hand: no process starts; the command line is called in-process)

import math
from markupsafe import escape
from ilab_nb.cli import main
from ilab_nb.compare import compare
from ilab_nb.evaluations import Evaluation
from ilab_nb.runstore import write_json_atomic

TRAIN = dict(total_steps=4, epoch=0.5, loss=2.0, learning_rate=1e-4, grad_norm=1.0, tokens=100, tokens_per_s=10.0,
             real_tokens_per_s=10.0, efficiency=1.0, elapsed_s=1.0, peak_mem_mb=None)


def _line(kind, **f) -> str: return json.dumps(dict(schema=1, kind=kind, run_id="r", attempt=1, time=1.0, **f)) + "\n"


def listed_run(root: Path, run_id: str, **state) -> Path:
    "A run that ended (`ended_run`) with two train records (step 2 of 4, loss 2.0): what every reader below reads."
    d = ended_run(root, run_id, **state)
    RunPaths(d).metrics.write_text("".join(_line("train", step=s, **TRAIN) for s in (1, 2)))
    return d


def every_reader(root: Path, run_id: str, capsys) -> dict:
    "What each reader shows of run `run_id`: list_runs' row, `ilab-nb ls` and `status`, the record, the dashboard, report.html."
    row = next(r for r in FineTuneSession.list_runs(root) if r["run_id"] == run_id)
    assert main(["ls", "--runs-root", str(root)]) == 0
    ls = capsys.readouterr().out
    assert main(["status", run_id, "--runs-root", str(root)]) == 0
    status = capsys.readouterr().out
    s = FineTuneSession.attach(run_id, runs_root=root)
    d = s.dashboard(autostart=False); d.update()
    shown = "".join(w.value for w in (d.header, d.progress_text, getattr(d, "eval_view", d.failure)))
    return dict(row=row, ls=ls, status=status, record=s.record()._repr_mimebundle_()["text/html"],
                text=repr(s.record()), dashboard=shown, report=s.report().path.read_text())


def test_a_run_whose_metrics_file_is_a_directory_is_listed_with_a_note_and_so_is_every_other(tmp_path, capsys):
    "metrics.jsonl made a directory: list_runs and `ilab-nb ls` (IsADirectoryError for the whole root before) show both runs."
    root = tmp_path / "runs"; listed_run(root, "good"); d = listed_run(root, "odd")
    RunPaths(d).metrics.unlink(); RunPaths(d).metrics.mkdir()
    got, said = every_reader(root, "odd", capsys), "metrics.jsonl is not a file (a directory)"
    assert [(r["run_id"], r["step"], r["note"]) for r in FineTuneSession.list_runs(root)] == [("good", 2, None), ("odd", None, said)]
    assert f"odd: {said}" in got["ls"] and ["good", "failed", "1", "2/4"] in [l.split()[:4] for l in got["ls"].splitlines()]
    assert f"note:     {said}" in got["status"] and f"note: {said}" in got["text"]
    for where in ("record", "dashboard", "report"): assert said in got[where], where


def test_a_state_field_of_the_wrong_type_is_left_out_and_named_by_every_reader(tmp_path, capsys):
    """state.json with a string attempt ("2", "x") and other typed fields of the wrong type: record(), the dashboard and
    report() raised TypeError; now each field is left out (as if missing), named, and the rest of the run shows."""
    root = tmp_path / "runs"; listed_run(root, "good"); d = listed_run(root, "odd", reason="it broke")
    bad = dict(attempt="2", created_at="yesterday", updated_at="x", exit_code="1", world_size="2", ended_at=[1])
    st = json.loads(RunPaths(d).state.read_text()); RunPaths(d).state.write_text(json.dumps({**st, **bad}))
    e = listed_run(root, "odd-x"); st = json.loads(RunPaths(e).state.read_text())
    RunPaths(e).state.write_text(json.dumps({**st, "attempt": "x"}))
    got = every_reader(root, "odd", capsys)
    said = [f"state.json: field {f!r} = {v!r} is not {t}, so it is left out" for f, v, t in
            (("attempt", "2", "int"), ("created_at", "yesterday", "float"), ("exit_code", "1", "int?"))]
    assert got["row"]["attempt"] is None and got["row"]["status"] == State.failed and got["row"]["step"] == 2
    assert all(n in got["row"]["note"] for n in said)
    assert [r["run_id"] for r in FineTuneSession.list_runs(root)] == ["good", "odd", "odd-x"]
    assert "odd-x: state.json: field 'attempt' = 'x' is not int, so it is left out" in got["ls"]
    assert all(f"note:     {n}" in got["status"] for n in said) and "reason:   it broke" in got["status"]
    for where in ("record", "dashboard", "report"):
        assert all(str(escape(n)) in got[where] for n in said) and "step <b>2</b> / 4" in got[where], where
    assert "Run failed:</b> it broke" in got["record"]
    s = FineTuneSession.attach("odd", runs_root=root)
    assert "attempt" not in s.state and "state_problems" not in json.loads(RunPaths(d).state.read_text())   # read, not written


def test_a_running_run_whose_supervisor_is_no_process_reference_is_listed_as_written(tmp_path, capsys):
    "`supervisor: {pid: 'x'}` raised ValueError into list_runs for the whole root; now said, and nothing is finalized."
    root = tmp_path / "runs"; listed_run(root, "good"); d = listed_run(root, "odd", status=State.cancelled)
    st = json.loads(RunPaths(d).state.read_text())
    RunPaths(d).state.write_text(json.dumps({**st, "status": "running", "supervisor": {"pid": "x", "create_time": 1.0}}))
    row = FineTuneSession.list_runs(root)[1]
    assert row["status"] == State.running and "supervisor {'pid': 'x', 'create_time': 1.0} is no process reference" in row["note"]
    assert main(["ls", "--runs-root", str(root)]) == 0 and "odd: state.json: supervisor" in capsys.readouterr().out
    assert json.loads(RunPaths(d).state.read_text())["status"] == "running"                 # not finalized on that account


def _evaluated_run(root: Path, scores: dict) -> Path:
    "A run with one completed evaluation whose trained model's `task` record has `scores` (the base's is a number)."
    d = listed_run(root, "evald", status=State.completed)
    store = RunStore(RunPaths(d).evals); e = store.create_run("eval-1")
    write_json_atomic(RunPaths(e).config, dict(kind="eval", run_id="evald", tasks=["heldout"],
                                               models=[dict(label="base", path="m"), dict(label="tuned", path="m")]))
    store.write_state("eval-1", status=State.completed, attempt=1)
    task = lambda model, sc: json.dumps(dict(schema=1, kind="task", run_id="eval-1", attempt=1, time=1.0, model=model,
                                             task="heldout", status="done", scores=sc)) + "\n"
    RunPaths(e).metrics.write_text(task("base", {"exact_match,none": [0.25, 0.1], "f1": [0.5, None]}) + task("tuned", scores))
    return d


def test_an_evaluation_score_that_is_not_a_number_shows_as_missing_with_a_note(tmp_path, capsys):
    "A `task` record's score 'oops' broke results(), and so the record, the dashboard, report() and compare(): now a note."
    root = tmp_path / "runs"
    d = _evaluated_run(root, {"exact_match,none": "oops", "f1": ["0.7", 0.1]})
    df = Evaluation(RunPaths(d).evals / "eval-1").results()
    assert [(r.metric, r.base) for r in df.itertuples()] == [("exact_match,none", 0.25), ("f1", 0.5)]
    assert df.tuned.isna().all() and len(df.attrs["notes"]) == 2
    said = "tuned on heldout: score exact_match,none = 'oops' is not a number, so it is left out"
    assert said == df.attrs["notes"][0] and "score f1 = ['0.7', 0.1] is not a number" in df.attrs["notes"][1]
    got = every_reader(root, "evald", capsys)
    for where in ("record", "dashboard", "report"):
        assert str(escape(said)) in got[where] and "step <b>2</b> / 4" in got[where], where
    cmp = compare([d])
    assert math.isnan(cmp.summary[0]["heldout/exact_match,none"]) and f"evald: {said}" in repr(cmp)


@pytest.mark.parametrize("verb", ["chat", "export", "eval", "fork"])
def test_every_verb_takes_the_same_checkpoint_and_refuses_garbage_naming_it(verb, tmp_path, capsys):
    "`--checkpoint`: a step, 'latest' (eval refused it: type=int) or a folder; anything else is argparse's exit 2."
    from ilab_nb.cli import build_parser
    root = tmp_path / "runs"; listed_run(root, "r"); folder = tmp_path / "model"; folder.mkdir()
    base = [verb, "r", "--runs-root", str(root)] + (["--tasks", "heldout"] if verb == "eval" else [])
    parse = lambda c: build_parser().parse_args(base + ["--checkpoint", c]).__dict__["step" if verb == "fork" else "checkpoint"]
    assert [parse("latest"), parse("12")] == [None if verb == "fork" else "latest", 12]
    if verb != "fork": assert parse(str(folder)) == str(folder)
    for garbage in ("-3", "1.5", "lastest", str(tmp_path / "no-such-folder")):
        with pytest.raises(SystemExit) as e: main(base + ["--checkpoint", garbage])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "argument --" in err and "--checkpoint" in err and f"{garbage!r} is neither" in err, err


@pytest.mark.parametrize("args,option,said", [
    (["logs", "r", "-n", "-5"], "-n", "'-5' is not a whole number of at least 1"),
    (["logs", "r", "-n", "0"], "-n", "0 lines prints nothing"),
    (["eval", "r", "--tasks", "heldout", "--limit", "0"], "--limit", "'0' is neither a number of documents per task"),
    (["eval", "r", "--tasks", "heldout", "--limit", "-2"], "--limit", "'-2' is neither"),
    (["chat", "r", "--max-new-tokens", "0"], "--max-new-tokens", "'0' is not a whole number of at least 1"),
    (["chat", "r", "--temperature", "-0.5"], "--temperature", "'-0.5' is not a number of at least 0"),
    (["chat", "r", "--temperature", "nan"], "--temperature", "'nan' is not a number of at least 0"),
    (["stop", "r", "--grace", "-1"], "--grace", "'-1' is not a number of at least 0"),
    (["demo", "--eval-limit", "-1"], "--eval-limit", "'-1' is not a whole number of at least 1"),
])
def test_a_count_or_amount_out_of_range_is_argparses_error_naming_the_option(args, option, said, tmp_path, capsys):
    "`logs -n -5` printed nothing and exited 0: each numeric option refuses what it cannot mean, exit status 2."
    root = tmp_path / "runs"; listed_run(root, "r")
    with pytest.raises(SystemExit) as e: main(args + ["--runs-root", str(root)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument {option}: {said}" in err, err
    if args[:2] == ["logs", "r"]:                 # -n 0 with -f follows from now on (a run that ended: its last line)
        assert main(["logs", "r", "-n", "0", "-f", "--runs-root", str(root)]) == 0
        assert capsys.readouterr().out == "--- run r failed (attempt 1)\n"


def test_a_grpo_run_that_cannot_learn_is_said_so_by_every_reader(tmp_path, capsys):
    """GRPO train records whose rewards were all None (NaN), and others whose groups all scored alike three batches in a
    row, or whose reward function failed and was left out (reward_errors='skip'): every reader says it, beside the run."""
    root = tmp_path / "runs"
    grpo = lambda step, **f: _line("train", step=step, **{**TRAIN, "reward": 0.5, "frac_reward_zero_std": 0.0, **f})
    cases = {"none": ([grpo(1), grpo(2, reward=float("nan"))],
                      "no reward function scored any completion at step 2 (every reward None): the run cannot learn"),
             "flat": ([grpo(s, frac_reward_zero_std=1.0) for s in (1, 2, 3)],
                      "every group's rewards were equal in the last 3 generation batches (steps 1-3): every advantage was "
                      "0, so the run learned nothing"),
             "skipped": ([grpo(1, **{"rewards/judge/failure_frequency": 0.5})],
                         "reward function 'judge' failed in 50% of its calls at step 1; their rewards were left out")}
    for run_id, (lines, _) in cases.items(): RunPaths(ended_run(root, run_id)).metrics.write_text("".join(lines))
    for run_id, (_, said) in cases.items():
        got = every_reader(root, run_id, capsys)
        assert said in got["row"]["note"] and f"{run_id}: {said}" in got["ls"] and said in got["status"], run_id
        for where in ("record", "dashboard", "report"): assert str(escape(said)) in got[where], (run_id, where)
