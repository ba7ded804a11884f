"""Evaluation with lm-evaluation-harness, for real: the run's own `heldout` task on the suite's demo run (the untrained
model answers about nothing, the trained one as the demo's own measure says, within 2 points; lm-eval's own command
line on the kept task YAML gives the same numbers), `eval_tasks` run when a
run completes and shown in its record, and what goes wrong said clearly (a task lm-eval does not know, a data set that
cannot be loaded offline, a stop). `heldout_preference` rising on the DPO run: tests/test_dpo.py, beside that run."""
import json, os, re, subprocess, sys
from pathlib import Path

import pytest

from ilab_nb import FineTuneSession
from ilab_nb.demo import answer_prompts, read_chat_jsonl
from ilab_nb.evaluation import EvalError, check_tasks, evaluate_task, run_evaluation, write_own_tasks
from ilab_nb.evaluations import Evaluation
from ilab_nb.rundir import RunPaths, State
from ilab_nb.runstore import RunStore, write_json_atomic

from conftest import FIELDS, runs_env, within

BIN = Path(sys.executable).parent
DEMO_LIMIT = 40          # conversations: the demo_run's --eval-limit (tests/conftest.py)


@pytest.mark.processes
def test_heldout_on_the_demo_run_matches_the_demos_own_measure_and_lm_evals_cli(demo_run, demo, tmp_path):
    r, run_dir = demo_run
    before, after = map(float, re.search(r"held-out accuracy:\s+([\d.]+) ?% -> ([\d.]+) ?%", r.stdout).groups())
    n = len(answer_prompts(read_chat_jsonl(demo.eval_file)[:DEMO_LIMIT]))     # the questions the demo measured
    with pytest.MonkeyPatch.context() as mp:
        for k, v in runs_env(tmp_path).items(): mp.setenv(k, v)
        s = FineTuneSession.attach(run_dir.name, runs_root=run_dir.parent)
        ev = s.evaluate(["heldout"], limit=n)
        assert ev.wait(timeout=600) == State.completed, ev.reason
    df = ev.results().set_index("metric")
    base, tuned = df.loc["exact_match", "base"], df.loc["exact_match", "tuned"]
    print(f"\n[measured] heldout on {n} questions: base {base:.1%}, tuned {tuned:.1%}; the demo's own: {before}% -> {after}%")
    assert base <= 0.02 and tuned >= 0.8, (base, tuned, before, after)
    within("lm-eval's exact_match on the tuned model vs the demo's own accuracy (points)", abs(100 * tuned - after), 2, "0.03: the printed accuracy's rounding")
    assert df.loc["normalised_match", "tuned"] >= tuned
    # lm-eval's own files: results and samples, for each model
    for label in ("base", "tuned"):
        (res,) = (ev.dir / label).glob("results_*.json")
        assert json.loads(res.read_text())["results"]["heldout"]["exact_match,none"] == df.loc["exact_match", label]
        assert len((ev.dir / label).glob("samples_heldout_*.jsonl").__next__().read_text().splitlines()) == n
    # the kept task YAML through lm-eval's command line, on the trained model: the same numbers
    out = tmp_path / "cli"
    p = subprocess.run([str(BIN / "lm-eval"), "run", "--model", "hf", "--model_args", f"pretrained={run_dir / 'final'}",
                        "--tasks", "heldout", "--include_path", str(ev.dir / "tasks"), "--limit", str(n), "--batch_size", "16",
                        "--output_path", str(out)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    assert p.returncode == 0, p.stderr[-3000:]
    (cli,) = out.rglob("results_*.json")
    got = json.loads(cli.read_text())["results"]["heldout"]
    assert (got["exact_match,none"], got["normalised_match,none"]) == (tuned, df.loc["normalised_match", "tuned"]), got
    # the run's record lists the evaluation with its table
    assert ev.eval_id in s.record()._repr_mimebundle_()["text/html"]


@pytest.mark.processes
def test_eval_tasks_run_when_the_run_completes(demo, small_train, runs_root, tmp_path):
    held = tmp_path / "held.jsonl"
    held.write_text("".join(Path(demo.eval_file).read_text().splitlines(keepends=True)[:8]))
    s = FineTuneSession(model=str(demo.model_dir), data=str(small_train), eval_data=str(held), runs_root=runs_root,
                        **{**FIELDS, "num_processes": 1}, max_steps=2, eval_tasks=["heldout"])
    s.start()
    assert s.wait(timeout=600) == State.completed, s.reason
    eid = s.state["evaluation"]                              # named in the run's final state: queued as it completed
    ev = Evaluation(RunPaths(s.run_dir).evals / eid)
    assert ev.wait(timeout=600) == State.completed, ev.reason
    assert ev.spec["tasks"] == ["heldout"] and len(ev.results()) == 2
    page = (s.run_dir / "report.html").read_text()          # rewritten by the evaluation with its table
    assert eid in page and "exact_match" in page


def test_a_missing_task_a_missing_data_set_and_a_stop_are_said_clearly(demo, tmp_path, monkeypatch):
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer
    held = [{"kind": "chat", "messages": c} for c in read_chat_jsonl(demo.eval_file)[:2]]
    # lm-eval's index of the two task folders these names come from, its own YAML files: the whole index (14,683
    # tasks) takes 7.6 CPU-s to build, and the checks read only these
    import lm_eval.tasks as lm_tasks, ilab_nb.evaluation as E
    folders = [str(Path(lm_tasks.__file__).parent / f) for f in ("arc", "hellaswag")]
    monkeypatch.setattr(E, "lm_eval_tasks", lambda: lm_tasks.TaskManager(include_path=folders, include_defaults=False))
    with pytest.raises(EvalError, match="'hellaswagg' is neither one of the run's own .* did you mean 'hellaswag'"):
        check_tasks(["hellaswagg"], held)
    # a real lm-eval task, offline: the data set it needs is named
    # (datasets and huggingface_hub read these at import, which was before this test: their constants too)
    import datasets, huggingface_hub.constants as hub_constants
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1"); monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for mod, name in ((datasets.config, "HF_DATASETS_OFFLINE"), (datasets.config, "HF_HUB_OFFLINE"),
                      (hub_constants, "HF_HUB_OFFLINE")):
        monkeypatch.setattr(mod, name, True)
    tok = AutoTokenizer.from_pretrained(demo.model_dir)
    lm = HFLM(pretrained=AutoModelForCausalLM.from_pretrained(demo.model_dir), tokenizer=tok, batch_size=2)
    with pytest.raises(RuntimeError, match=r"task 'arc_easy': its data set \(allenai/ai2_arc / ARC-Easy\) could not be loaded"):
        evaluate_task(lm, "arc_easy", E.lm_eval_tasks(), 2, tmp_path / "out")
    # a stop: the evaluation process honours control/stop before its next task
    store = RunStore(tmp_path / "eval"); d = store.create_run("e-stop")
    write_own_tasks(d / "tasks", ["heldout"], held, tok)
    write_json_atomic(RunPaths(d).config, dict(kind="eval", run_id="r", tasks=["heldout"], limit=2, batch_size=2, device="cpu",
                                               models=[dict(label="base", path=str(demo.model_dir))]))
    RunPaths(d).stop.parent.mkdir(exist_ok=True); RunPaths(d).stop.write_text("{}")
    assert run_evaluation(RunPaths(d)) == "stopped"
    recs = [json.loads(l) for l in RunPaths(d).metrics.read_text().splitlines()]
    assert [r.get("event") for r in recs if r["kind"] == "event"] == ["stopped"] and not [r for r in recs if r["kind"] == "task"]
