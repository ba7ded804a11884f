"""One gate for every action on a run: every entry point (the session's methods, the command line's verbs) against
every rule (links, another user's files, values that would be markup, a bad metrics record, a LoRA base that moved,
a run directory that disappears), from one registry of entry points; then the failures that led to the gate, one
test each. A method added to FineTuneSession or a verb added to `ilab-nb` fails
`test_every_entry_point_is_gated_and_swept` until it is gated (ilab_nb.rundir.gated) and listed here."""
import inspect, json, os, pickle, re, shutil
from pathlib import Path

import pytest

from ilab_nb import FineTuneSession
from ilab_nb.cli import COMMANDS
from ilab_nb.config import TrainConfig
from ilab_nb.evaluations import Evaluation
from ilab_nb.rundir import ENTRY_POINTS, Action, OwnerError, RemoteCodeWarning, RunDirLinkError, RunGoneError, RunPaths, State
from ilab_nb.runstore import RunStore, write_json_atomic

from conftest import ilab

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="gives a run directory to another user (chown): needs root")
NOBODY = 65534
SCRIPT = "<script>alert(1)</script>"
IMG = "<img src=x onerror=alert(1)>"
SECRET = "the other file's text"

# --- the run every case starts from ---------------------------------------------------------------------------------

def _record(kind, **f):
    return json.dumps(dict(schema=1, kind=kind, run_id="r", attempt=1, time=1.0, **f)) + "\n"

HEADER = dict(world_size=1, backend=None, strategy="ddp", distributed_type="NO", device="cpu", device_type="cpu",
              precision="fp32", layout="ddp", attn_implementation="sdpa", total_steps=4, num_train_samples=8, num_eval_samples=0,
              resumed_from_step=None, params_total=10**6, params_per_rank=[10**6], gradient_checkpointing=False, plan={},
              data_stats={}, versions={}, load="full", mixed_precision=None, cpu_offload=False, torch_compile=None, loss="mean",
              num_machines=1, nodes=["n"])
TRAIN = dict(total_steps=4, epoch=0.5, loss=2.0, learning_rate=1e-4, grad_norm=1.0, tokens=100, tokens_per_s=10.0,
             real_tokens_per_s=10.0, efficiency=1.0, elapsed_s=1.0, peak_mem_mb=None)


def built_run(root: Path, demo, run_id="r", status=State.completed, lora_base: Path | None = None, **state) -> Path:
    """A finished run directory made by hand as a run leaves it: config, state, events, metrics, a log, final/ (the demo
    model, or LoRA adapters of `lora_base`) and a complete checkpoint; no process is started."""
    store = RunStore(root); d = store.create_run(run_id); p = RunPaths(d)
    TrainConfig(model=str(lora_base or demo.model_dir), data=[str(demo.train_file)], num_processes=1, device="cpu").to_json(p.config)
    store.write_state(run_id, status=status, attempt=1, num_processes=1, **state)
    store.append_event(run_id, "created")
    p.logs.mkdir(exist_ok=True); p.rank_log(0).write_text("step 1/4 loss 2.0\n")
    p.metrics.write_text(_record("header", **HEADER) + "".join(_record("train", step=s, **TRAIN) for s in (1, 2)))
    if lora_base is None: shutil.copytree(demo.model_dir, p.final)
    else: _adapters(lora_base, p.final)
    ck = p.checkpoint(2); shutil.copytree(demo.model_dir, ck); (ck / "COMPLETE").write_text("{}")
    (ck / "trainer_state.json").write_text(json.dumps({"step": 2, "epoch": 1.0}))
    return d


def _adapters(base: Path, out: Path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    pm = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=4, target_modules=["q_proj"]))
    pm.peft_config["default"].base_model_name_or_path = str(base)
    pm.save_pretrained(out / "adapter"); AutoTokenizer.from_pretrained(base).save_pretrained(out)


class _Opens:
    "Unpickled, it creates the file it names: a reward function's pickle that shows whether it was loaded."
    def __init__(self, path): self.path = str(path)
    def __reduce__(self): return (open, (self.path, "w"))


def grpo_shaped(d: Path, unpickled: Path) -> Path:
    """The run in `d` made a GRPO run whose config names its reward function `rewards/0-f.pkl` (and its source `.py`), a
    pickle that leaves `unpickled` when it is loaded; the .pkl."""
    p = RunPaths(d); p.rewards.mkdir(); pkl = p.rewards / "0-f.pkl"
    pkl.write_bytes(pickle.dumps(_Opens(unpickled))); (p.rewards / "0-f.py").write_text("def f(prompts, completions, **kw): ...\n")
    cfg = TrainConfig.read_json(p.config)
    TrainConfig(model=cfg.model, data=cfg.data, num_processes=1, device="cpu", method="grpo", reward_funcs=[str(pkl)]).to_json(p.config)
    return pkl


def chown_all(d: Path, uid=NOBODY):
    for q in [d, *d.rglob("*")]: os.chown(q, uid, uid, follow_symlinks=False)


def _queued(s):
    "The run as just queued (no supervisor yet, within its grace): one a stop() acts on."
    if s.run_dir.is_dir():
        s.store.write_state(s.run_id, status=State.queued, attempt=2, new_attempt=True)
        chown_all(s.run_dir, s.run_dir.stat().st_uid)            # as its owner left it
    return s


# --- the registry: every entry point, its kind, how the session calls it and how the command line does --------------

API = {   # name -> call on an attached session
    "state": lambda s: s.state, "status": lambda s: s.status, "reason": lambda s: s.reason, "progress": lambda s: s.progress(),
    "wait": lambda s: s.wait(timeout=5, progress=False), "metrics": lambda s: s.metrics(), "logs": lambda s: s.logs(),
    "checkpoints": lambda s: s.checkpoints, "checkpoint_at": lambda s: s.checkpoint_at(2), "model_path": lambda s: s.model_path(),
    "record": lambda s: s.record()._repr_mimebundle_()["text/html"], "snapshot": lambda s: s.snapshot()._repr_mimebundle_()["text/html"],
    "dashboard": lambda s: _dashboard_html(s), "evaluations": lambda s: [e.record_bundle()["text/html"] for e in s.evaluations],
    "report": lambda s: s.report().path.read_text(), "stop": lambda s: _queued(s).stop(wait=False),
    "resume": lambda s: s.resume(max_steps=8), "fork": lambda s: s.fork(2, max_steps=8),
    "fork_sweep": lambda s: s.fork_sweep(2, learning_rate=[1e-4, 2e-4]),
    "load_model": lambda s: s.load_model(), "chat": lambda s: s.chat(),
    "evaluate": lambda s: s.evaluate(["heldout"]), "export": lambda s: s.export(dtype="f32", progress=False),
}
CLI = {"status": ["status"], "logs": ["logs"], "watch": ["watch"], "stop": ["stop", "--no-wait"], "resume": ["resume", "--set", "max_steps=8"],
       "fork": ["fork", "--step", "2"], "chat": ["chat"], "report": ["report"], "eval": ["eval", "--tasks", "heldout"],
       "export": ["export", "--dtype", "f32"]}
CLI_KIND = {"status": "status", "logs": "logs", "watch": "wait", "stop": "stop", "resume": "resume", "fork": "fork", "chat": "chat",
            "report": "report", "eval": "evaluate", "export": "export"}
NOT_ON_A_RUN = {"start", "attach", "list_runs", "compare", "sweep", "search"}   # make runs, find one, read many (list_runs: below)
ON_A_SEARCH = {"search", "searches", "search-status", "search-stop", "search-extend", "search-resume"}  # its directory's gate: 66_search
HTML = ("record", "snapshot", "dashboard", "evaluations", "report")
FROM_FOLDER = {   # each entry point that loads a model, given a model folder as its checkpoint
    "load_model": lambda s, m: s.load_model(m), "chat": lambda s, m: s.chat(m),
    "evaluate": lambda s, m: s.evaluate(["heldout"], checkpoint=m), "export": lambda s, m: s.export(checkpoint=m, dtype="f32", progress=False)}
LOADS_MODEL = tuple(FROM_FOLDER)


def kinds(name) -> tuple: return ENTRY_POINTS[f"FineTuneSession.{name}"]
def acts(name) -> bool: return any(k != Action.read for k in kinds(name))


def _dashboard_html(s) -> str:
    d = s.dashboard(autostart=False)
    return "".join(w.value for w in (d.badge, d.header, d.progress_text, d.failure, d.log_view, d.checkpoint_view))


def test_every_entry_point_is_gated_and_swept():
    public = {n for n in vars(FineTuneSession) if not n.startswith("_")} - NOT_ON_A_RUN
    gated = {k.split(".", 1)[1] for k in ENTRY_POINTS if k.startswith("FineTuneSession.")}
    assert public - gated == set(), "not gated (ilab_nb.rundir.gated)"
    assert public - set(API) == set(), "gated, not in this sweep"
    takes_a_model = {n for n in public if callable(f := getattr(FineTuneSession, n)) and acts(n)
                     and "checkpoint" in inspect.signature(f).parameters}
    assert takes_a_model == set(FROM_FOLDER), "loads a model from a folder: add it to FROM_FOLDER"
    assert set(COMMANDS) - {"run", "ls", "demo"} - ON_A_SEARCH - set(CLI) == set(), "a command on a run the sweep does not run"
    assert ENTRY_POINTS["Evaluation.stop"] == (Action.write,)
    assert rules_applied_outside_the_gate() == [], "applies the gate's rules itself: call ilab_nb.rundir.gate"


RULE_PARTS = {"refuse_links", "refuse_foreign", "links_in", "owner_problem", "hard_links_in"}   # the gate's own parts (11_rundir)

def rules_applied_outside_the_gate() -> list:
    "`module:line name` for every import or call of one of the gate's parts in a module of ilab_nb other than rundir."
    import ast, ilab_nb
    out = []
    for f in sorted(Path(ilab_nb.__file__).parent.glob("*.py")):
        if f.name in ("rundir.py", "_modidx.py"): continue
        for n in ast.walk(ast.parse(f.read_text())):
            names = ([a.name for a in n.names] if isinstance(n, ast.ImportFrom) else
                     [n.func.id] if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) else
                     [n.func.attr] if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) else [])
            out += [f"{f.stem}:{n.lineno} {x}" for x in names if x in RULE_PARTS]
    return out


# --- the sweep: every entry point x every rule -----------------------------------------------------------------------

RULES = ("link", "owner", "markup", "bad record", "moved base", "removed", "their reward code", "writable reward code",
         "their model folder", "writable model folder")
USER_CODE_RULES = RULES[6:8]     # a file of the run's user code (rewards/*.pkl) another user's, or anyone's to write
FOLDER_RULES = RULES[8:]         # the model folder given as `checkpoint` another user's, or anyone's to write


def _cases():
    for name in API:
        for rule in RULES:
            if rule in ("owner", "their reward code", "their model folder") and not ROOT: continue
            if rule == "writable reward code" and Action.code not in kinds(name): continue   # reading: once is enough
            if rule == "markup" and name not in HTML: continue                  # no page: nothing to escape
            if rule == "bad record" and acts(name) and name not in ("report", "stop"): continue   # reads no metrics
            if rule in ("moved base", *FOLDER_RULES) and name not in LOADS_MODEL: continue      # loads no model
            yield pytest.param(name, rule, id=f"{name}-{rule}")


@pytest.fixture
def hostile(demo, tmp_path):
    "`(session, rule)` -> the attached session of a run to which `rule` was done; what a rule may not touch lies in tmp/elsewhere."
    def make(rule):
        root, out = tmp_path / "runs", tmp_path / "elsewhere"; out.mkdir()
        (out / "secret.txt").write_text(SECRET + "\n")
        base = None
        if rule == "moved base":
            base = tmp_path / "base"; shutil.copytree(demo.model_dir, base)
        d = built_run(root, demo, lora_base=base, **(dict(status=State.failed, reason=SCRIPT, log_tail=[IMG]) if rule == "markup" else {}))
        p = RunPaths(d)
        if rule == "moved base": base.rename(tmp_path / "moved")
        if rule == "link": p.rank_log(1).symlink_to(out / "secret.txt")
        if rule in USER_CODE_RULES: pkl = grpo_shaped(d, out / "unpickled")     # in elsewhere/: would show as a new file
        if rule == "bad record":
            with open(p.metrics, "a") as f: f.write(_record("train", **{**TRAIN, "step": "7"}) + "[1]\n")
        if rule == "markup":
            with open(p.metrics, "a") as f:
                f.write(_record("header", **{**HEADER, "device": SCRIPT, "strategy": IMG, "finetuning": "lora", "trainable_params": 10,
                                             "lora": {"r": IMG, "target_parameters": [SCRIPT]}}))
                f.write(_record("samples", step=2, epoch=1.0, seconds=0.1, max_new_tokens=4, samples=[{"prompt": SCRIPT, "answer": IMG}]))
            e = RunStore(p.evals).create_run("eval-1")
            write_json_atomic(RunPaths(e).config, dict(run_id=SCRIPT, tasks=[IMG], models=[dict(label=SCRIPT, path="m")]))
            RunStore(p.evals).write_state("eval-1", status=State.failed, attempt=1, reason=IMG)
            (RunPaths(e).metrics).write_text(_record("task", model=SCRIPT, task=IMG, status="done", scores={SCRIPT: [1.0, None]}))
        s = FineTuneSession.attach(d.name, runs_root=root)
        if rule == "owner": chown_all(d)
        if rule == "their reward code": os.chown(pkl, NOBODY, NOBODY)
        if rule in FOLDER_RULES:                                              # beside the runs root, as any folder
            shutil.copytree(demo.model_dir, theirs := tmp_path / "their-model")
            chown_all(theirs) if rule == "their model folder" else os.chmod(theirs, 0o777)
        if rule == "writable reward code": os.chmod(pkl, 0o666)
        if rule == "removed": shutil.rmtree(d)
        return s, out
    return make


@pytest.mark.parametrize("name,rule", list(_cases()))
def test_every_entry_point_holds_every_rule(name, rule, hostile):
    s, out = hostile(rule)
    before = sorted((q.name, q.read_bytes()) for q in out.rglob("*") if q.is_file())
    call = API[name]
    if rule in ("link", "owner") and acts(name) and name != "stop" or rule == "link" and name == "stop":
        with pytest.raises(RunDirLinkError if rule == "link" else OwnerError, match="will not"):
            call(s)
    elif rule == "owner" and name == "stop":
        with pytest.raises(OwnerError, match="will not stop it"): call(s)
        assert not RunPaths(s.run_dir).stop.exists()
    elif rule in USER_CODE_RULES and Action.code in kinds(name):     # runs the run's code: the reward function's too
        why = "is owned by nobody .uid 65534." if rule == "their reward code" else "is writable by every user"
        with pytest.raises(OwnerError, match=f"rewards/0-f.pkl {why}.*; ilab_nb will not .* unless you trust its owner"):
            call(s)
    elif rule in FOLDER_RULES:                                         # the checkpoint a loader is given: the same rule
        m = s.run_dir.parent.parent / "their-model"
        why = "is owned by nobody .uid 65534." if rule == "their model folder" else "is writable by every user"
        with pytest.raises(OwnerError, match=f"{re.escape(str(m))} {why}.*; ilab_nb will not .* unless you trust its owner"):
            FROM_FOLDER[name](s, m)
        assert not RunPaths(s.run_dir).exports.exists() and not RunPaths(s.run_dir).evals.exists()
    elif rule == "moved base":
        with pytest.raises(ValueError, match="which is no longer there .moved or deleted..; put it back.*base_model=PATH"):
            call(s)
    elif rule == "removed":
        if acts(name):
            with pytest.raises(FileNotFoundError): call(s)
        else:
            try: call(s)
            except (FileNotFoundError, RuntimeError) as e: assert s.run_id in str(e) or str(s.run_dir) in str(e)
    else:                                            # read anything; a bad record and markup leave the page whole
        got = str(call(s))
        assert SECRET not in got
        if rule == "markup": assert "<script" not in got and "<img src=x" not in got, got
        if rule == "bad record" and name in HTML and name != "evaluations": assert "2 unreadable records in metrics.jsonl, lines 4, 5" in got
    if rule == "owner" and acts(name):             # the other user's run is as it was: nothing written, nothing started
        assert not any(q.stat().st_uid != NOBODY for q in [s.run_dir, *s.run_dir.rglob("*")])
    assert sorted((q.name, q.read_bytes()) for q in out.rglob("*") if q.is_file()) == before


@needs_root
@pytest.mark.processes
def test_the_command_line_asks_the_same_gate(demo, tmp_path):
    "Every `ilab-nb` verb that runs a run's code or writes into it, on another user's run: refused naming the owner, rc 2."
    root = tmp_path / "runs"; d = built_run(root, demo); chown_all(d)
    for verb, args in CLI.items():
        if not acts(CLI_KIND[verb]) or verb == "stop": continue       # reading is free (the sweep above); a completed run has nothing to stop
        r = ilab(*args[:1], "r", *args[1:], "--runs-root", root, input="")
        assert r.returncode == 2 and "is owned by nobody (uid 65534)" in r.stderr and "--trust-owner" in r.stderr, (verb, r.stderr)
    ilab("status", "r", "--runs-root", root, check=0)
    assert not any(q.stat().st_uid != NOBODY for q in [d, *d.rglob("*")])


# --- the failures that led to the gate, one test each ----------------------------------------------------------------

@needs_root
@pytest.mark.processes
def test_another_users_model_code_is_not_run_by_chat_load_model_or_evaluate(demo, tmp_path, monkeypatch):
    """A run owned by nobody whose model names code of its own (trust_remote_code): `ilab-nb chat`, load_model() and
    evaluate() refuse it as resume() does, and its code does not run; with trust_owner=True it does (the check is what
    stopped it), and load_model, chat, export and evaluate name its files and their owner first, saying where it runs."""
    root = tmp_path / "runs"; d = built_run(root, demo); p = RunPaths(d)
    ran = tmp_path / "the-code-ran"
    (p.final / "configuration_theirs.py").write_text(f"open({str(ran)!r}, 'w').write('x')\n")
    mc = json.loads((p.final / "config.json").read_text())
    (p.final / "config.json").write_text(json.dumps({**mc, "auto_map": {"AutoConfig": "configuration_theirs.TheirConfig"}}))
    TrainConfig.read_json(p.config).model_copy(update=dict(trust_remote_code=True)).to_json(p.config)
    chown_all(d)
    s = FineTuneSession.attach("r", runs_root=root)
    for call, doing in ((lambda: s.load_model(), "load its model"), (lambda: s.evaluate(["heldout"]), "evaluate it"),
                        (lambda: s.chat(), "chat with its model")):
        with pytest.raises(OwnerError, match=f"owned by nobody .uid 65534., not by you .*will not {doing} unless you trust its owner"):
            call()
    r = ilab("chat", "r", "--runs-root", root, check=2, input="hi\n")
    assert "is owned by nobody (uid 65534)" in r.stderr and not ran.exists()
    named = ("trust_remote_code=True: the model's own code will run {}: configuration_theirs.py \\(nobody \\(uid 65534\\)\\) in "
             + re.escape(str(p.final)))
    def no_process(*a, **k): raise RuntimeError("no evaluation process here")
    monkeypatch.setattr("ilab_nb.launcher.spawn_supervisor", no_process)
    for call, where in ((lambda: s.load_model(trust_owner=True), "in this process"), (lambda: s.chat(trust_owner=True), "in this process"),
                        (lambda: s.export(dtype="f32", progress=False, trust_owner=True), "in this process and in the export process"),
                        (lambda: s.evaluate(["heldout"], trust_owner=True), "in the evaluation process")):
        with pytest.warns(RemoteCodeWarning, match=named.format(where)), pytest.raises(Exception):
            call()                         # named first; then their code ran (it defines no TheirConfig), or the run has no held-out data
    assert ran.exists()                                              # (imported once: transformers keeps the module)


@needs_root
@pytest.mark.processes
def test_export_never_writes_through_a_planted_link(demo, tmp_path):
    """nobody's run with `export/<name>.Modelfile` a link to root's file, or `export/` itself a link: `ilab-nb export`
    refuses (the owner; with --trust-owner, the link), and root's file keeps its bytes; a link in place of a file is
    replaced, never written through, by the one write helper."""
    root = tmp_path / "runs"; d = built_run(root, demo); p = RunPaths(d)
    mine = tmp_path / "roots-file"; mine.write_text("root's own\n")
    p.exports.mkdir(); (p.exports / "r-final-f32.Modelfile").symlink_to(mine)
    chown_all(d)
    r = ilab("export", "r", "--dtype", "f32", "--runs-root", root, check=2)
    assert "is owned by nobody (uid 65534)" in r.stderr
    r = ilab("export", "r", "--dtype", "f32", "--trust-owner", "--runs-root", root, check=2)
    assert "export/r-final-f32.Modelfile -> " in r.stderr and "so it will not export it" in r.stderr
    shutil.rmtree(p.exports); p.exports.symlink_to(tmp_path, target_is_directory=True)
    r = ilab("export", "r", "--dtype", "f32", "--trust-owner", "--runs-root", root, check=2)
    assert "holds 1 symbolic link(s) (export -> " in r.stderr
    assert mine.read_text() == "root's own\n" and not list(tmp_path.glob("*.gguf"))


def test_values_from_a_run_reach_no_page_raw(demo, tmp_path, hostile):
    "Markup in a header's strings, LoRA settings, samples, a reason, an evaluation's spec: text on every page, never markup."
    s, _ = hostile("markup")
    pages = [API[n](s) for n in HTML] + [RunPaths(s.run_dir).report.read_text()]
    for page in pages: assert "<script" not in page and "<img src=x" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in pages[0] and "LoRA r=&lt;img src=x onerror=alert(1)&gt;" in pages[0]


@pytest.mark.processes
def test_one_bad_record_is_skipped_and_counted_never_raised_into_a_listing(demo, tmp_path):
    "A string `step` and a line that is not an object: `ilab-nb ls`, list_runs(), status, record and report go on and say it."
    root = tmp_path / "runs"; built_run(root, demo, run_id="good"); d = built_run(root, demo, run_id="bad")
    with open(RunPaths(d).metrics, "a") as f: f.write(_record("train", **{**TRAIN, "step": "7"}) + "[1]\n")
    r = ilab("ls", "--runs-root", root, check=0)
    assert "bad: 2 unreadable records in metrics.jsonl, lines 4, 5" in r.stdout and "good" in r.stdout
    assert [x["run_id"] for x in FineTuneSession.list_runs(root)] == ["bad", "good"]
    s = FineTuneSession.attach("bad", runs_root=root)
    assert [m["step"] for m in s.metrics()] == [1, 2] and s.progress()["step"] == 2
    assert "2 unreadable records" in s.record()._repr_mimebundle_()["text/html"]
    assert "2 unreadable records" in s.report().path.read_text()


@pytest.mark.processes
def test_a_removed_run_directory_ends_its_evaluation_and_export_failed(demo, tmp_path):
    """An evaluation queued in a run whose directory is then removed reads `failed` ("run directory removed") at once:
    wait() returns, stop() says so; an export whose run directory goes is ended at its next tensor."""
    from ilab_nb.export import run_export
    root = tmp_path / "runs"; d = built_run(root, demo)
    store = RunStore(RunPaths(d).evals); e = store.create_run("eval-1")
    write_json_atomic(RunPaths(e).config, dict(run_id="r", tasks=["heldout"], models=[]))
    store.write_state("eval-1", status=State.queued, attempt=1)
    ev = Evaluation(e); assert ev.status == State.queued
    shutil.rmtree(d)
    assert ev.wait(timeout=5) == State.failed and ev.reason == "run directory removed" and ev.stop() == State.failed
    with pytest.raises(RunGoneError, match="run directory removed while it was exported; the export was ended"):
        run_export(demo.model_dir, tmp_path / "out" / "m.gguf", "f32", progress=False, alive=lambda: False)
    assert not list((tmp_path / "out").glob("*"))


@pytest.mark.processes
def test_a_lora_run_whose_base_moved_is_said_by_export_and_evaluate_and_exports_with_base_model(demo, tmp_path):
    "export() and evaluate() say the moved base as load_model does (not huggingface_hub's 'Repo id'); base_model= exports it."
    base = tmp_path / "base"; shutil.copytree(demo.model_dir, base)
    root = tmp_path / "runs"; built_run(root, demo, lora_base=base)
    base.rename(tmp_path / "moved")
    s = FineTuneSession.attach("r", runs_root=root)
    with pytest.raises(ValueError, match=f"LoRA adapters of the base model {base}, which is no longer there.*export\\(\\.\\.\\., base_model=PATH\\)"):
        s.export(dtype="f32", progress=False)
    with pytest.raises(ValueError, match="no longer there.*evaluate\\(\\.\\.\\., base_model=PATH\\)"):
        s.evaluate(["heldout"])
    f = s.export(dtype="f32", progress=False, base_model=tmp_path / "moved")
    assert f.exists() and f.read_bytes()[:4] == b"GGUF"


@pytest.mark.processes
def test_export_and_evaluate_ask_before_launch(demo, tmp_path):
    "limit, a checkpoint given as '2', a file that is not ours at the target, f16 past its range: said before launch or at the tensor."
    import torch
    from safetensors.torch import load_file, save_file
    root = tmp_path / "runs"; built_run(root, demo)
    s = FineTuneSession.attach("r", runs_root=root)
    for bad in (0, -1, "abc", True):
        with pytest.raises(ValueError, match=f"limit={bad!r} is not a number of documents"): s.evaluate(["heldout"], limit=bad)
    theirs = tmp_path / "notes.txt"; theirs.write_text("mine\n")
    with pytest.raises(FileExistsError, match="notes.txt exists and is not a GGUF file; it is not replaced unless you pass overwrite=True"):
        s.export(checkpoint="2", path=theirs, dtype="f32", progress=False)  # '2' is the step, as fork takes it (not a folder '2')
    assert theirs.read_text() == "mine\n"
    w = RunPaths(s.run_dir).final / "model.safetensors"; sd = load_file(w)
    name = next(k for k in sd if k.endswith("q_proj.weight")); sd[name] = sd[name] * 0 + 1e6
    save_file(sd, w, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="holds values up to 1e\\+06, past f16's range .65504.*dtype='bf16'"):
        s.export(dtype="f16", progress=False)


def test_a_run_whose_every_step_was_skipped_fails_instead_of_completing(demo, small_train, runs_root, monkeypatch, tmp_path):
    """skip_nonfinite_steps=True and every step not finite (tests/nan_worker.py, NAN_EVERY_STEP): failed, no final/ of
    the untouched model. Trained here as rank 0 of 1 (`train_here`): the worker raises the reason; a launched run's
    reason from a non-finite step is tests/test_hostile.py's huge learning rate (a supervisor and a rank, ~5 CPU-s)."""
    import importlib, sys
    import ilab_nb.worker as W
    from conftest import FIELDS, train_here
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    monkeypatch.setenv("NAN_EVERY_STEP", "1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"): monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(W.Attempt, "train_step", W.Attempt.train_step)      # restored after the test: nan_worker patches it
    importlib.reload(sys.modules["nan_worker"]) if "nan_worker" in sys.modules else importlib.import_module("nan_worker")
    model = _without_template(demo, tmp_path / "no-template")         # and a tokenizer with no chat template: said, not filled in silently
    s = FineTuneSession(model=str(model), data=str(small_train), **{**FIELDS, "num_processes": 1}, max_steps=2,
                        skip_nonfinite_steps=True, runs_root=runs_root)
    said = "the tokenizer has no chat template: ilab_nb's default (ChatML) formats the conversations"
    assert s.preflight["data"]["chat_template"].startswith(said)
    with pytest.raises(W.NonFiniteError, match=re.escape("every step of this attempt (1..2) was skipped as not finite "
                                                         "(skip_nonfinite_steps): no update was applied")):
        try: train_here(s)
        finally:
            import torch.distributed as dist
            if dist.is_available() and dist.is_initialized(): dist.destroy_process_group()   # as the rank's exit would
    assert not RunPaths(s.run_dir).final.exists()
    from ilab_nb.monitor import data_notes
    header = s.metrics(kinds=("header",))[-1]
    assert any(n.startswith("chat template: " + said) for n in data_notes(header)), header
    assert [e["event"] for e in s.metrics(kinds=("event",))][-1] == "failed"      # the rank's own record of it


def _without_template(demo, out: Path) -> Path:
    "The demo model with its tokenizer's chat template taken out."
    shutil.copytree(demo.model_dir, out)
    (out / "chat_template.jinja").unlink(missing_ok=True)
    tc = json.loads((out / "tokenizer_config.json").read_text()); tc.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(tc))
    return out


def test_evaluate_refuses_held_out_data_changed_since_the_run(demo, tmp_path):
    """The run's header holds the sha256 of the held-out records it read (data_stats.heldout): eval_data edited since,
    its modification time set back so that no time tells, is refused before anything is queued, naming the file; a
    file only touched since holds the run's records and passes."""
    from ilab_nb.data import load_records, records_sha256
    from ilab_nb.evaluation import check_heldout_unchanged
    root = tmp_path / "runs"; d = built_run(root, demo)
    lines = Path(demo.eval_file).read_text().splitlines(keepends=True)
    held = tmp_path / "held.jsonl"; held.write_text("".join(lines[:4]))
    p = RunPaths(d); cfg = TrainConfig.read_json(p.config).model_copy(update=dict(eval_data=[str(held)])); cfg.to_json(p.config)
    ran = dict(rows=4, sha256=records_sha256(load_records([str(held)])))         # as the worker writes it (34_worker)
    with open(p.metrics, "a") as f: f.write(_record("header", **{**HEADER, "data_stats": {"heldout": ran}}))
    s = FineTuneSession.attach("r", runs_root=root)
    os.utime(held)                                                               # touched after the run: its records are the run's
    check_heldout_unchanged(s, s.config, ["heldout"], load_records([str(held)]))
    st = held.stat(); held.write_text("".join(lines[:3] + lines[5:6])); os.utime(held, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(ValueError, match=f"{held} changed since run r read it: the 4 held-out records read now are not the 4 "
                                         "the run held out .their sha256 differs.; put the file back"):
        s.evaluate(["heldout"])
    assert not p.evals.exists() or not list(p.evals.iterdir())


def test_evaluate_refuses_an_lm_eval_task_whose_data_set_is_not_here_offline(demo, tmp_path, monkeypatch):
    """evaluate(['arc_easy']) with no network and no copy in the datasets cache: refused before anything is queued,
    naming the task and its data set (read from lm-eval's task index: here a one-task index, as cheap stand-in for
    lm-eval's fifteen thousand task files); with a prepared copy in the cache, the check passes."""
    import datasets
    from lm_eval.tasks import TaskManager
    import ilab_nb.evaluation as E
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "arc_easy.yaml").write_text("task: arc_easy\ndataset_path: allenai/ai2_arc\ndataset_name: ARC-Easy\n"
                                                       "output_type: multiple_choice\ndoc_to_text: q\ndoc_to_target: 0\ndoc_to_choice: [a, b]\n")
    monkeypatch.setattr(E, "lm_eval_tasks", lambda: TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1"); monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    root = tmp_path / "runs"; d = built_run(root, demo)
    s = FineTuneSession.attach("r", runs_root=root)
    with pytest.raises(ValueError, match="task 'arc_easy' reads the data set allenai/ai2_arc .ARC-Easy., which is not in the Hugging "
                                         "Face datasets cache .*HF_HUB_OFFLINE is set: load it once where there is network"):
        s.evaluate(["arc_easy"])
    assert not RunPaths(d).evals.exists() or not list(RunPaths(d).evals.iterdir())
    (tmp_path / "cache" / "allenai___ai2_arc" / "ARC-Easy" / "0.0.0" / "0123abcd").mkdir(parents=True)
    assert E.check_tasks(["arc_easy"], []) == ["arc_easy"]


@pytest.mark.processes
def test_a_killed_exports_unfinished_file_is_removed_by_the_next_export_saying_so(demo, tmp_path, capsys):
    """export/<name>.gguf's temporary file (named by its writer's pid and start) whose writer was killed (SIGKILL) is
    removed by the next export into that folder, which says so; the file of a writer still alive is left alone."""
    import subprocess
    from ilab_nb.export import main, tmp_path as tmp_of
    from ilab_nb.runstore import ProcessRef
    root = tmp_path / "runs"; d = built_run(root, demo); ex = RunPaths(d).exports; ex.mkdir()
    w = subprocess.Popen(["sleep", "60"])                 # the writer, as cheap as a process gets
    left = tmp_of(ex / "r-final-f32.gguf", ProcessRef.of(w.pid)); left.write_bytes(b"GGUF"); w.kill(); w.wait()
    live = tmp_of(ex / "other.gguf", ProcessRef.of()); live.write_bytes(b"GGUF")
    assert left.exists() and left.name.startswith(f".r-final-f32.gguf.tmp-{w.pid}-")
    assert main([str(demo.model_dir), str(ex / "r-final-f32.gguf"), "--dtype", "f32"]) == 0      # `python -m ilab_nb.export`, in this process
    assert (ex / "r-final-f32.gguf").exists() and not left.exists() and live.exists()
    said = f"warning: removed {left}, the unfinished file of an export process (pid {w.pid}) that is gone"
    assert said in capsys.readouterr().err                # what run_export (session.export) relays as a warning


@pytest.mark.processes
def test_a_modelfile_that_would_render_differently_from_the_models_template_is_warned(demo, tmp_path, caplog):
    "A chat template that trims each message: the Modelfile's template writes them as they are, so the export warns, saying where."
    from ilab_nb.export import run_export
    model = tmp_path / "trims"; shutil.copytree(demo.model_dir, model)
    t = (model / "chat_template.jinja").read_text()
    (model / "chat_template.jinja").write_text(t.replace("{{ m['content'] }}", "{{ m['content'] | trim }}"))
    with caplog.at_level("WARNING", logger="ilab_nb.export"):
        f = run_export(model, tmp_path / "out" / "m.gguf", "f32", progress=False)
    assert f.modelfile is not None
    assert "the model's chat template changes them (trims?): at character" in caplog.text, caplog.text


@pytest.mark.processes
def test_logs_rank_takes_a_number_and_an_earlier_attempts_rank(demo, tmp_path):
    "`--rank abc` is said as what to give; `--rank 1` of a run resumed on 1 process prints the log its first attempt's rank 1 left."
    root = tmp_path / "runs"; d = built_run(root, demo)
    RunPaths(d).rank_log(1).write_text("rank one's line\n")
    r = ilab("logs", "r", "--rank", "abc", "--runs-root", root, check=2)
    assert "--rank 'abc': give a rank number (0, 1, ...) or 'supervisor'" in r.stderr
    assert "rank one's line" in ilab("logs", "r", "--rank", "1", "--runs-root", root, check=0).stdout
