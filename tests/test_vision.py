"""Training a vision-language model on images, for real: the vision demo's tiny LLaVA (nbs/45_vision_demo: a CLIP
tower, a projector and a Llama, made here at random) learns "What colour is the shape?" on 2 CPU processes under
FSDP, from rows whose images are PIL images held by this process (saved into the run as files, so that the run
outlives what held them), among rows without an image (their micro-batches run the sharded tower on a placeholder). Stopped while it trains and resumed from its checkpoint, it ends answering at least 90% of
the held-out questions, which the model it started from answers none of, having trained its language model alone
(the vision tower and the projector frozen: LLaMA-Factory's defaults); its final/ loads with transformers'
AutoModelForImageTextToText and AutoProcessor, as a downloaded model does, and the session's load_model() gives that
model with its processor. Asked about three held-out images at each evaluation (eval_prompts with image parts), the
run's sample answers are the final model's, and its record shows each image's thumbnail beside its question; the
session's chat, given an image with a question, answers as the final model does; its evaluate() scores the held-out
questions with their images (lm-eval's hf-multimodal model type) as the final model answers them. GRPO on prompts with
images, on 2 FSDP ranks, raises the probability of the right answer."""
from pathlib import Path

import pytest
import torch

from ilab_nb import FineTuneSession
from ilab_nb.data import load_records
from ilab_nb.vision import part_of, vision_parts, with_images
from ilab_nb.vision_demo import COLOURS, vision_assets
from conftest import wait_until

pytestmark = pytest.mark.processes      # a 2-rank run, stopped and resumed

# Measured on 2 ranks with this test's rows (its 16 without an image), the tower and projector frozen, as accuracy on
# the 60 held-out questions with this seed and seeds 3 and 42 (the data's order differs; the model is the same). A
# constant lr 3e-3 learns them by step 50-60 but then swings from checkpoint to checkpoint: 100% at steps 50-70 with
# this seed, 95% at step 60 and 76.7% at 70 with seed 3, 96.7%, 86.7%, 98.3%, 91.7% at steps 40-70 with seed 42; 150
# steps through the stop: 100% at steps 50-100, 83.3% at 125, 95% at 150. Decayed linearly to 0 it settles: over 80
# steps 100%, 98.3%, 98.3% without the stop and the same through the stop at step 41 (this test's run); over 100 steps
# through a stop at step 26: 100%, 98.3%, 98.3%. A higher lr learns slower (5e-3 over 60 steps, linear or cosine:
# 5-77%). Earlier, 150 steps at the constant lr: training every part instead gave 100%, 98.3% and 93.3%; with 40 rows
# without an image, 93.3%.
STEPS, LEARNING_RATE, SCHEDULE, SEED, TEXT_ROWS = 80, 3e-3, "linear", 7, 16
SAVE_STEPS = STEPS // 2      # the stop comes after the first checkpoint, half way
EVAL_LIMIT = 20          # held-out questions that evaluate() answers, for the base model and the trained one


def answers(model, processor, records) -> list[str]:
    "The greedy answer of `model` to each record's question about its image."
    model, out = model.eval(), []
    for r in records:
        enc = processor.apply_chat_template(with_images({**r, "messages": r["messages"][:1]}), tokenize=True,
                                            return_dict=True, return_tensors="pt", add_generation_prompt=True)
        with torch.no_grad(): ids = model.generate(**enc, max_new_tokens=4, do_sample=False)
        out.append(processor.tokenizer.decode(ids[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip())
    return out


def asked(record) -> list[dict]:
    "A held-out record's question as an eval prompt: the user's turn, its image part naming the file."
    question = record["messages"][0]["content"][1]["text"]
    return [{"role": "user", "content": [{"type": "image", "image": record["images"][0]},
                                         {"type": "text", "text": question}]}]


def score(said, records) -> float:
    "The share of `records` whose answer is `said`'s (the answers to them, in order)."
    return sum(a == r["messages"][1]["content"][0]["text"] for a, r in zip(said, records)) / len(records)


def accuracy(model, processor, records) -> float:
    return score(answers(model, processor, records), records)


def test_a_vision_language_model_learns_colours_from_pil_images_on_two_ranks_through_a_stop(runs_root):
    from PIL import Image
    va = vision_assets()
    train, held = load_records(str(va.train_file)), load_records(str(va.eval_file))
    rows = [{"messages": [{"role": "user", "content": r["messages"][0]["content"][1]["text"]},
                          {"role": "assistant", "content": r["messages"][1]["content"][0]["text"]}],
             "images": [Image.open(r["images"][0]).convert("RGB")]} for r in train]      # held by this process only
    rows += [{"messages": [{"role": "user", "content": "Which shape has three sides?"},     # rows without an image,
                           {"role": "assistant", "content": "triangle"}]}] * TEXT_ROWS     # batched apart from the rest
    s = FineTuneSession(str(va.model_dir), rows, eval_data=str(va.eval_file), runs_root=runs_root, num_processes=2,
                        strategy="fsdp", device="cpu", max_steps=STEPS, learning_rate=LEARNING_RATE,
                        lr_scheduler_type=SCHEDULE, max_seq_len=64, max_tokens_per_batch=1024, save_steps=SAVE_STEPS,
                        eval_steps=None, seed=SEED, eval_prompts=[asked(r) for r in held[:3]], eval_max_new_tokens=4)
    assert s.preflight["data"]["train"]["samples"] == len(rows)
    s.start()
    saved = Path(s.run_dir) / "data"
    distinct = {r["images"][0].tobytes() for r in rows if "images" in r}  # (two drawings may come out the same)
    assert len(list((saved / "images").glob("*.png"))) == len(distinct)    # the images, in the run, as files
    assert all(r["images"][0].startswith(str(saved / "images")) for r in load_records(str(saved / "train.jsonl"))
               if r.get("images"))

    wait_until(lambda: s.checkpoints, 300, what="a checkpoint of the vision run")
    assert s.stop(timeout=120) == "cancelled", s.reason
    stopped = s.checkpoints[-1]["step"]
    assert 0 < stopped < STEPS
    s.resume()
    assert s.wait(timeout=600) == "completed", s.reason
    assert s.state["resumed_from_step"] == stopped

    from transformers import AutoModelForImageTextToText, AutoProcessor
    final = Path(s.run_dir) / "final"
    assert {"processor_config.json", "chat_template.jinja", "model.safetensors"} <= {p.name for p in final.iterdir()}
    base = AutoModelForImageTextToText.from_pretrained(va.model_dir), AutoProcessor.from_pretrained(va.model_dir)
    trained = AutoModelForImageTextToText.from_pretrained(final), AutoProcessor.from_pretrained(final)
    # each question answered alone and greedily: the answers to any of them are these (generated once, read below)
    said_before, said = answers(*base, held), answers(*trained, held)
    before, after = score(said_before, held), score(said, held)
    was, now, parts = base[0].state_dict(), trained[0].state_dict(), vision_parts(trained[0])
    assert {part_of(k, parts) for k in was if not torch.equal(was[k], now[k])} == {"language_model"}   # the rest frozen
    model, processor = s.load_model()                          # the session's own: the model and its processor
    assert type(processor).__name__ == "LlavaProcessor"
    assert answers(model, processor, held[:8]) == said[:8]
    # the sample answers, generated in the run (2 ranks, one left-padded batch), are the final model's, beside each image
    samples = s.metrics(kinds=("samples",))
    assert (samples[0]["step"], samples[-1]["step"]) == (0, STEPS)        # at each evaluation (each epoch's end)
    assert [x["images"] for x in samples[-1]["samples"]] == [r["images"] for r in held[:3]]
    assert [x["answer"] for x in samples[-1]["samples"]] == said[:3]
    box = s.chat(max_new_tokens=4)                                    # the chat takes an image with a message
    box.send(held[0]["messages"][0]["content"][1]["text"], image=held[0]["images"][0])
    assert box.wait(60) and box.error is None, box.error
    assert box.chat.messages[-1]["content"] == said[0]
    s.report()
    assert (Path(s.run_dir) / "report.html").read_text().count("image-rendering:pixelated") == 3   # their thumbnails
    print(f"held-out accuracy ({len(held)} questions, {len(COLOURS)} colours): {before:.1%} before, {after:.1%} after "
          f"{STEPS} steps on 2 ranks (stopped at step {stopped}, resumed)")
    assert before <= 1 / len(COLOURS) and after >= 0.9, (before, after)
    # evaluate(): the run's own held-out questions with their images, through lm-eval's hf-multimodal model type
    ev = s.evaluate(["heldout"], limit=EVAL_LIMIT)
    assert ev.wait(timeout=300) == "completed", ev.reason
    df = ev.results().set_index("metric")
    print(f"heldout through lm-eval ({EVAL_LIMIT} questions): base {df.loc['exact_match', 'base']:.1%}, tuned "
          f"{df.loc['exact_match', 'tuned']:.1%}")
    assert df.loc["exact_match", "tuned"] == score(said[:EVAL_LIMIT], held[:EVAL_LIMIT])   # same answers, same score
    assert df.loc["exact_match", "base"] == score(said_before[:EVAL_LIMIT], held[:EVAL_LIMIT])


# GRPO on prompts with images (TRL's: the images are the prompt's), from the vision model partly trained here (40 SFT
# steps, 1 process), 20 steps on 2 FSDP ranks, 4 prompts x 8 completions a step, rewarded for the right colour. Measured
# here: the held-out expected reward (the probability of the right answer) 0.279 -> 0.349 after 20 steps (a rise of
# 0.070, twice REWARD_RISE), through 0.312, 0.320, 0.325 at steps 5, 10, 15 and on to 0.381 and 0.396 at steps 25 and
# 30 (30 steps were this test's until 20 proved enough; 1 process, 30 steps: 0.387); the greedy answers, already right
# wherever the likeliest answer was, stay at 61.7% over 20 steps as over 30 (as the text GRPO test found of its own:
# tests/test_grpo.py).
SFT_STEPS, GRPO_STEPS, GRPO_LR, REWARD_RISE = 40, 20, 3e-4, 0.035


def right_colour(prompts, completions, answer, **kw):
    return [1.0 if c[-1]["content"].strip() == a else 0.0 for c, a in zip(completions, answer)]


def expected_reward(model, processor, records) -> float:
    "The mean probability of the right answer (its tokens and the turn's end) to each question about its image."
    model, ps = model.eval(), []
    for r in records:
        enc = processor.apply_chat_template(with_images(r), tokenize=True, return_dict=True, return_tensors="pt",
                                            return_assistant_tokens_mask=True)
        answer = enc.pop("assistant_masks")[0, 1:].bool()
        with torch.no_grad(): lp = torch.log_softmax(model(**enc).logits[0, :-1].float(), -1)
        ps.append(float(lp[answer].gather(-1, enc["input_ids"][0, 1:][answer].unsqueeze(-1)).sum().exp()))
    return sum(ps) / len(ps)


def test_grpo_on_prompts_with_images_raises_the_right_answers_probability_on_two_ranks(runs_root, tmp_path):
    import json
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from conftest import train_here
    from ilab_nb.vision_demo import QUESTION
    va = vision_assets()
    held = load_records(str(va.eval_file))
    sft = FineTuneSession(str(va.model_dir), str(va.train_file), runs_root=runs_root, num_processes=1, device="cpu",
                          max_steps=SFT_STEPS, learning_rate=LEARNING_RATE, lr_scheduler_type="constant", max_seq_len=64,
                          max_tokens_per_batch=1024, save_steps=None, eval_steps=None, seed=SEED)
    assert train_here(sft) == "completed"
    start = Path(sft.run_dir) / "final"

    def prompts(path, records):
        path.write_text("".join(json.dumps({"prompt": QUESTION, "image": r["images"][0],
                                            "answer": r["messages"][1]["content"][0]["text"]}) + "\n" for r in records))
        return str(path)
    s = FineTuneSession(str(start), prompts(tmp_path / "train.jsonl", load_records(str(va.train_file))),
                        eval_data=prompts(tmp_path / "held.jsonl", held), runs_root=runs_root, method="grpo",
                        num_processes=2, strategy="fsdp", device="cpu", max_steps=GRPO_STEPS, learning_rate=GRPO_LR,
                        lr_scheduler_type="constant", max_seq_len=64, max_tokens_per_batch=1024, save_steps=None,
                        eval_steps=GRPO_STEPS, seed=0, num_generations=8, per_device_train_batch_size=16,
                        max_completion_length=4, reward_funcs=[right_colour], num_completions_to_print=2)
    s.start()
    assert s.wait(timeout=600) == "completed", s.reason
    base = AutoModelForImageTextToText.from_pretrained(start), AutoProcessor.from_pretrained(start)
    tuned = AutoModelForImageTextToText.from_pretrained(Path(s.run_dir) / "final"), base[1]
    before, after = expected_reward(*base, held), expected_reward(*tuned, held)
    evals = {r["step"]: r["eval_reward"] for r in s.metrics(kinds=("eval",))}
    print(f"GRPO on images, {GRPO_STEPS} steps on 2 ranks: held-out expected reward {before:.3f} -> {after:.3f}; greedy "
          f"{evals[0]:.1%} -> {evals[GRPO_STEPS]:.1%}")
    assert evals[0] == pytest.approx(accuracy(*base, held))      # the run's greedy answers, the model's own
    assert after >= before + REWARD_RISE, (before, after)
    shown = s.metrics(kinds=("completions",))[0]["completions"]
    assert [c["prompt"] for c in shown] == [QUESTION] * 2 and {c["reward"] for c in shown} <= {0.0, 1.0}, shown
    firsts = [json.loads(line)["image"] for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert all(len(c["images"]) == 1 and c["images"][0] in firsts for c in shown), shown     # each prompt's own image
    from ilab_nb.completions import completions_html, latest_completions
    assert completions_html(latest_completions(s.metrics(kinds=("completions",)))).count("<img ") == 2
