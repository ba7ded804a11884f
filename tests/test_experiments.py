"""Issue 11, with real processes: trackers (TensorBoard's and MLflow's own readers, W&B's offline transaction log), sample answers at each
evaluation under FSDP, and chatting with a run's model. The finished run they read is conftest's `tracked_run`
(2-rank FSDP, eval prompts, TensorBoard and MLflow), shared with tests/test_schema.py. (A real sweep through the
device queue, attached from another process: the tutorial's, in tests/test_notebooks_headless.py.)"""
import json, os, subprocess, sys

import pytest

from ilab_nb.monitor import RunMonitor
from ilab_nb.rundir import schema_problems
from ilab_nb import FineTuneSession      # with the sweep grown onto it (ilab_nb.sweep)
from conftest import PROMPTS, ilab, wait_until

pytestmark = pytest.mark.timeout(400)


def _jsonl(s, kind):
    m = RunMonitor(s.run_dir); m.poll()
    return [r for r in m.records if r.get("kind") == kind]


@pytest.mark.processes
def test_tensorboard_scalars_equal_metrics_jsonl(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tracked_run.run_dir / "tensorboard")); acc.Reload()
    for tag, kind, key in (("train/loss", "train", "loss"), ("eval/loss", "eval", "eval_loss")):
        want = [(r["step"], r[key]) for r in _jsonl(tracked_run, kind)]
        got = [(e.step, e.value) for e in acc.Scalars(tag)]
        assert [s for s, _ in got] == [s for s, _ in want] and len(want) >= 3
        assert all(v == pytest.approx(w, rel=1e-6) for (_, v), (_, w) in zip(got, want))   # TensorBoard stores float32


@pytest.mark.processes
def test_mlflow_metric_history_equals_metrics_jsonl(tracked_run):
    from mlflow.tracking import MlflowClient
    from ilab_nb.trackers import mlflow_tracking_uri
    ref = json.loads((tracked_run.run_dir / "mlflow.json").read_text())
    c = MlflowClient(mlflow_tracking_uri(tracked_run.run_dir))
    assert ref["tracking_uri"].endswith("/runs/.mlruns")
    assert [r["run_id"] for r in FineTuneSession.list_runs(tracked_run.store.root)] == [tracked_run.run_id]   # the store is no run
    for tag, kind, key in (("train/loss", "train", "loss"), ("eval/loss", "eval", "eval_loss")):
        want = [(r["step"], r[key]) for r in _jsonl(tracked_run, kind)]
        assert [(m.step, m.value) for m in c.get_metric_history(ref["run_id"], tag)] == want
    run = c.get_run(ref["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["final_model_path"] == str(tracked_run.run_dir / "final")
    assert run.data.params["learning_rate"] == "0.001" and run.data.params["num_processes"] == "2"


def wandb_records(path):
    """The protobuf records of a W&B transaction log (`run-<id>.wandb`): LevelDB's log format (32 KiB blocks of
    records with a 7-byte header: CRC, length, type full/first/middle/last) after W&B's 7-byte `:W&B` header. W&B's
    Python package no longer reads these (its Go core does), so the suite reads them to check what an offline run holds."""
    import struct
    from wandb.proto import wandb_internal_pb2 as pb
    data, out, part, block = path.read_bytes(), [], b"", 32768
    assert data[:4] == b":W&B", data[:7]
    pos = 7
    while pos + 7 <= len(data):
        if block - pos % block < 7: pos += block - pos % block; continue            # a block's padding
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7]); pos += 7
        part += data[pos:pos + n]; pos += n
        if kind in (1, 4): r = pb.Record(); r.ParseFromString(part); out.append(r); part = b""
    return out


@pytest.mark.processes
def test_wandb_offline_run_holds_the_metrics_under_the_dashboards_names(tracked_run):
    (log,) = (tracked_run.run_dir / "wandb").glob(f"offline-run-*/run-{tracked_run.run_id}.wandb")
    recs = wandb_records(log)
    rows = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for r in recs if r.WhichOneof("record_type") == "history"]
    for tag, kind, key in (("train/loss", "train", "loss"), ("eval/loss", "eval", "eval_loss")):
        want = [(r["step"], r[key]) for r in _jsonl(tracked_run, kind)]
        assert [(h["_step"], h[tag]) for h in rows if tag in h] == want
    config = next(r.run.config for r in recs if r.WhichOneof("record_type") == "run")
    assert {i.key: json.loads(i.value_json) for i in config.update}["learning_rate"] == 0.001
    assert [r.exit.exit_code for r in recs if r.WhichOneof("record_type") == "exit"] == [0]


@pytest.mark.processes
def test_trackio_storage_holds_the_metrics_read_back_by_trackio(tracked_run):
    "trackio's own storage (what its dashboard reads), in a process of its own: trackio reads TRACKIO_DIR once."
    read = ("import json; from trackio.sqlite_storage import SQLiteStorage as S; "
            "print(json.dumps(dict(runs=S.get_runs('ilab_nb'), logs=S.get_logs('ilab_nb', S.get_runs('ilab_nb')[0]), "
            "config=S.get_run_config('ilab_nb', S.get_runs('ilab_nb')[0])), default=str))")
    out = subprocess.run([sys.executable, "-c", read], capture_output=True, text=True, check=True, timeout=120,
                         env={**os.environ, "TRACKIO_DIR": str(tracked_run.run_dir / "trackio")})
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["runs"] == [tracked_run.run_id]
    for tag, kind, key in (("train/loss", "train", "loss"), ("eval/loss", "eval", "eval_loss")):
        want = [(r["step"], r[key]) for r in _jsonl(tracked_run, kind)]
        assert [(l["step"], l[tag]) for l in got["logs"] if tag in l] == want
    samples = [l for l in got["logs"] if "samples" in l]
    assert [l["step"] for l in samples] == [0, 2, 4] and samples[0]["samples"]["_value"][0]["prompt"] == PROMPTS[0]
    assert got["config"]["learning_rate"] == "0.001" and got["config"]["num_processes"] == "2"


@pytest.mark.processes
def test_samples_at_each_evaluation(tracked_run):
    samples, evals = _jsonl(tracked_run, "samples"), _jsonl(tracked_run, "eval")
    assert [r["step"] for r in samples] == [r["step"] for r in evals] == [0, 2, 4]
    for r in samples:
        assert [x["prompt"] for x in r["samples"]] == [PROMPTS[0], PROMPTS[1][-1]["content"]]
        assert all(isinstance(x["answer"], str) for x in r["samples"]) and r["seconds"] > 0 and r["max_new_tokens"] == 6
        assert schema_problems(r, "samples") == []


def test_missing_tracker_is_an_error_at_construction(demo, small_train, runs_root, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)     # as if the extra were not installed (find_spec says None)
    with pytest.raises(ValueError, match="report_to") as e:
        FineTuneSession(demo.model_dir, small_train, runs_root=runs_root, report_to="mlflow", device="cpu")
    assert "pip install 'ilab_nb[mlflow]'" in str(e.value), str(e.value)
    assert not runs_root.exists() or not any(runs_root.iterdir())


@pytest.mark.processes
def test_chat_box_streams_and_stops(tracked_run, demo):
    "The chat box answers over the run's final model; over the untrained demo model it streams a long answer and Stop ends it."
    from ilab_nb.chat import ChatBox
    box = tracked_run.chat(temperature=0.0, max_new_tokens=8)
    box.input.value = "What is the capital of Nutoland?"           # what Enter does
    assert box.wait(120) and box.error is None and "done" in box.status.value
    assert [m["role"] for m in box.chat.messages] == ["user", "assistant"] and "ilab-chat-user" in box.transcript.value
    box.send("And its currency?"); assert box.wait(120)
    assert [m["role"] for m in box.chat.messages] == ["user", "assistant"] * 2      # multi-turn
    # streaming and Stop: the untrained model's greedy answer to this prompt runs the full 400 tokens if not stopped
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(demo.model_dir)
    long = ChatBox(AutoModelForCausalLM.from_pretrained(demo.model_dir), tok, max_new_tokens=400)
    forward, calls = long.chat.model.forward, []
    def held(*a, **k):      # the answer is held at its 300th token until Stop: Stop always comes while it streams
        calls.append(1)
        if len(calls) > 300: long.chat.stop_event.wait(300)
        return forward(*a, **k)
    long.chat.model.forward = held
    partial = []
    long.transcript.observe(lambda ch: partial.append(ch["new"]) if "▌" in ch["new"] else None, names="value")
    long.send("Tell me everything.")
    wait_until(lambda: len(partial) >= 3, 120, poll=0.01, what="three streamed pieces")
    long.stop_button.click()
    assert long.wait(120) and "stopped" in long.status.value
    assert len(partial[0]) < len(partial[2])                        # the answer grew piece by piece
    assert len(tok(long.chat.messages[-1]["content"])["input_ids"]) < 400


@pytest.mark.processes
def test_cli_chat(tracked_run):
    out = ilab("chat", tracked_run.run_id, "--runs-root", tracked_run.store.root, "--max-new-tokens", "4", "--checkpoint", "latest",
               input="What is the capital of Nutoland?\n/reset\nHi\n/quit\n", timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("model> ") == 2 and "(conversation reset)" in out.stdout
