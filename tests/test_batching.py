"""ilab_nb.batching: plans within budget and balanced; packed and bucketed collation give each sequence
exactly the logits it has alone; the loss helper matches a manual computation."""
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import within, max_abs_diff

from ilab_nb.batching import (LAYOUTS, attn_implementation_for, batch_cost, choose_layout, collate, plan_epoch, varlen_available,
                              plan_stats, token_loss_sum)

torch.set_num_threads(1)


def long_tail(n, seed=0, lo=20, hi=1024):
    "Lognormal token lengths clipped to lo..hi: many short samples, a long tail."
    return np.clip(np.random.default_rng(seed).lognormal(5.0, 0.8, n), lo, hi).astype(int).tolist()


def flat(plan):
    return [i for step in plan for batch in step for i in batch]


# ---------------------------------------------------------------- plans

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_plan_within_budget_every_rank_busy_no_duplicates(layout, world_size):
    lengths = long_tail(3000, seed=world_size)
    plan = plan_epoch(lengths, 4096, world_size, layout, seed=7, epoch=0)
    assert plan and all(len(step) == world_size for step in plan)
    assert all(batch for step in plan for batch in step), "a rank got an empty micro-batch"
    assert max(batch_cost([lengths[i] for i in b], layout) for step in plan for b in step) <= 4096
    used = flat(plan)
    assert len(used) == len(set(used)), "a sample appears twice in one epoch"
    stats = plan_stats(plan, lengths, layout)
    assert stats["samples_dropped"] == 0 and sorted(used) == list(range(len(lengths)))
    assert stats["micro_steps"] == len(plan) and stats["samples_used"] == len(lengths)
    assert stats["real_tokens"] == sum(lengths)
    assert all(type(i) is int for i in used)  # plain ints: usable as dataset indices and in JSON


@pytest.mark.parametrize("layout", LAYOUTS)
def test_plan_is_deterministic_and_reshuffled_each_epoch(layout):
    lengths = long_tail(2000)
    a = plan_epoch(lengths, 2048, 2, layout, seed=3, epoch=0)
    assert a == plan_epoch(lengths, 2048, 2, layout, seed=3, epoch=0)
    b = plan_epoch(lengths, 2048, 2, layout, seed=3, epoch=1)
    c = plan_epoch(lengths, 2048, 2, layout, seed=4, epoch=0)
    assert a != b and a != c
    assert sorted(flat(a)) == sorted(flat(b))
    # the micro-steps are in random order, not in order of length (or cost), and differently each epoch
    mean_len = [np.mean([lengths[i] for batch in step for i in batch]) for step in a]
    step_cost = [max(batch_cost([lengths[i] for i in batch], layout) for batch in step) for step in a]
    assert abs(spearman(range(len(a)), mean_len)) < 0.2 and abs(spearman(range(len(a)), step_cost)) < 0.2
    pos_b = {frozenset(map(frozenset, step)): k for k, step in enumerate(b)}
    common = [(k, pos_b[key]) for k, step in enumerate(a) if (key := frozenset(map(frozenset, step))) in pos_b]
    if len(common) > 10:  # micro-steps that recur in the next epoch (bucketed) come at other places
        assert abs(spearman(*zip(*common))) < 0.3
    else:                 # packed rows are recomposed each epoch
        assert layout == "packed"
    # which rank gets the costlier batch is random too
    costs = [[batch_cost([lengths[i] for i in batch], layout) for batch in step] for step in a]
    rank0_costlier = [c0 > c1 for c0, c1 in costs if c0 != c1]
    assert len(rank0_costlier) > 10 and 0.2 < np.mean(rank0_costlier) < 0.8


def spearman(x, y):
    rx, ry = np.argsort(np.argsort(list(x))), np.argsort(np.argsort(list(y)))
    return float(np.corrcoef(rx, ry)[0, 1])


def test_bucketed_efficiency_beats_naive_random_padding():
    lengths = long_tail(4000, seed=1)
    stats = plan_stats(plan_epoch(lengths, 4096, 2, "bucketed", seed=0, epoch=0), lengths, "bucketed")
    # naive baseline: random order, a padded batch filled until the next sample would exceed the same budget
    naive_computed, batch = 0, []
    for i in np.random.default_rng(0).permutation(len(lengths)).tolist():
        if batch and batch_cost([lengths[j] for j in batch + [i]], "bucketed") > 4096:
            naive_computed += batch_cost([lengths[j] for j in batch], "bucketed"); batch = []
        batch.append(i)
    naive_computed += batch_cost([lengths[j] for j in batch], "bucketed")
    naive_eff = sum(lengths) / naive_computed
    assert stats["efficiency"] > 0.9, stats
    assert naive_eff < stats["efficiency"] - 0.3, (naive_eff, stats["efficiency"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ranks_balanced(layout):
    lengths = long_tail(5000, seed=2)
    stats = plan_stats(plan_epoch(lengths, 4096, 4, layout, seed=0, epoch=0), lengths, layout)
    assert stats["rank_imbalance"] < 0.02, stats
    if layout == "packed":
        assert stats["rank_imbalance_max"] < 0.02, stats
        # rows are nearly full: few micro-steps for the data
        assert stats["computed_tokens"] / (stats["micro_steps"] * 4 * 4096) > 0.97, stats


def test_plan_stats_values():
    lengths = [4, 2, 3, 3]
    plan = [[[0, 1], [2, 3]]]
    s = plan_stats(plan, lengths, "bucketed")
    assert (s["real_tokens"], s["computed_tokens"], s["micro_steps"], s["samples_used"], s["samples_dropped"]) == (12, 14, 1, 4, 0)
    assert s["efficiency"] == pytest.approx(12 / 14) and s["rank_imbalance"] == pytest.approx(8 / 7 - 1)
    s = plan_stats(plan, lengths + [5], "packed")
    assert s["efficiency"] == 1.0 and s["rank_imbalance"] == 0.0 and s["samples_dropped"] == 1
    assert plan_stats([], [3], "packed")["samples_dropped"] == 1


@pytest.mark.parametrize("layout", LAYOUTS)
def test_leftover_that_cannot_fill_all_ranks_is_dropped_and_counted(layout):
    lengths = [100] * 5  # each sample fills the whole budget: 5 micro-batches cannot be shared by 2 ranks
    plan = plan_epoch(lengths, 100, 2, layout, seed=0, epoch=0)
    assert len(plan) == 2 and all(len(b) == 1 for step in plan for b in step)
    assert plan_stats(plan, lengths, layout)["samples_dropped"] == 1
    assert plan_epoch([100], 100, 2, layout, seed=0, epoch=0) == []
    # a leftover that can be split is spread instead: 3 samples of 50, 2 ranks, budget 100
    plan = plan_epoch([50, 50, 50], 100, 2, layout, seed=0, epoch=0)
    assert sorted(flat(plan)) == [0, 1, 2] and all(b for step in plan for b in step)


def test_plan_errors_are_actionable():
    with pytest.raises(ValueError, match=r"sample 1 has 300 tokens.*max_tokens=256.*at least 300"):
        plan_epoch([10, 300], 256, 1, "packed", seed=0, epoch=0)
    with pytest.raises(ValueError, match="'packed', 'bucketed'"):
        plan_epoch([10], 256, 1, "padded", seed=0, epoch=0)
    with pytest.raises(ValueError, match="sample 0 has length 0"):
        plan_epoch([0, 3], 256, 1, "bucketed", seed=0, epoch=0)


# ---------------------------------------------------------------- collation against a real model

def tiny_llama(attn):
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=100, max_position_embeddings=256, attn_implementation=attn)
    return LlamaForCausalLM(cfg).eval()


def sequences(lengths=(7, 13, 4), seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 100, (n,), generator=g).tolist() for n in lengths]


def alone(model, seq):
    with torch.no_grad():
        return model(input_ids=torch.tensor([seq]), use_cache=False).logits[0]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logits_equal_each_sequence_alone(attn):
    model, seqs = tiny_llama(attn), sequences()
    batch = collate([dict(input_ids=s, labels=s) for s in seqs], "packed", pad_id=0)
    assert batch["attention_mask"] is None and batch["input_ids"].shape == (1, sum(map(len, seqs)))
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=None,
                       use_cache=False).logits[0]
        leaky = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                      attention_mask=torch.ones_like(batch["input_ids"]), use_cache=False).logits[0]
    start, leaked = 0, []
    for s in seqs:
        ref = alone(model, s)
        within(f"packed ({attn}) logits vs the sequence alone", max_abs_diff(packed[start:start + len(s)], ref), 1e-5, "7.8e-8")
        leaked.append((leaky[start:start + len(s)] - ref).abs().max().item())
        start += len(s)
    # negative control: with a 2-D mask of ones the sequences after the first attend to their predecessors
    assert leaked[0] < 1e-5 and min(leaked[1:]) > 1e-3, leaked


def test_packed_needs_use_cache_false():
    "transformers 5 only detects packed sequences without a KV cache: the default use_cache=True leaks."
    model, seqs = tiny_llama("sdpa"), sequences()
    batch = collate([dict(input_ids=s, labels=s) for s in seqs], "packed", pad_id=0)
    with torch.no_grad():
        default = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
    n0 = len(seqs[0])
    assert (default[n0:n0 + len(seqs[1])] - alone(model, seqs[1])).abs().max() > 1e-3


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_bucketed_logits_equal_each_sequence_alone(attn):
    model, seqs = tiny_llama(attn), sequences()
    batch = collate([dict(input_ids=s, labels=s) for s in seqs], "bucketed", pad_id=0)
    assert batch["input_ids"].shape == (3, 13) and batch["attention_mask"].sum().item() == 24
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    position_ids=batch["position_ids"], use_cache=False).logits
    for r, s in enumerate(seqs):
        within(f"bucketed ({attn}) logits vs the sequence alone", max_abs_diff(out[r, :len(s)], alone(model, s)), 1e-5, "4.5e-8")


def test_collate_labels_and_counts():
    samples = [dict(input_ids=[1, 2, 3, 4], labels=[-100, -100, 3, 4]), dict(input_ids=[5, 6], labels=[5, 6]),
               dict(input_ids=[7], labels=[7])]
    # num_loss_tokens of a sample: labels != -100 at positions >= 1
    expected = sum(sum(l != -100 for l in s["labels"][1:]) for s in samples)
    p = collate(samples, "packed", pad_id=0)
    assert p["labels"].tolist() == [[-100, -100, 3, 4, -100, 6, -100]]
    assert p["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 0]]
    b = collate(samples, "bucketed", pad_id=9)
    assert b["input_ids"].tolist() == [[1, 2, 3, 4], [5, 6, 9, 9], [7, 9, 9, 9]]
    assert b["labels"].tolist() == [[-100, -100, 3, 4], [-100, 6, -100, -100], [-100, -100, -100, -100]]
    for out in (p, b):
        assert int(out["num_loss_tokens"]) == expected == 3 and int(out["num_real_tokens"]) == 7
    # tensors (a datasets.Dataset in torch format) work as well as lists
    t = collate([{k: torch.tensor(v) for k, v in s.items()} for s in samples], "packed", pad_id=0)
    assert torch.equal(t["labels"], p["labels"])
    with pytest.raises(ValueError, match="sample 1 of the micro-batch has 2 input_ids and 1 labels"):
        collate([samples[0], dict(input_ids=[1, 2], labels=[1])], "packed", pad_id=0)
    with pytest.raises(ValueError, match="empty micro-batch"):
        collate([], "bucketed", pad_id=0)


# ---------------------------------------------------------------- loss

def test_token_loss_sum_matches_manual_and_model_loss():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11, dtype=torch.float64)
    labels = torch.tensor([[-100, 3, -100, 7, 1], [-100, -100, 4, -100, -100]])
    manual = sum(-torch.log_softmax(logits[r, t - 1], -1)[labels[r, t]] for r in range(2) for t in range(1, 5)
                 if labels[r, t] != -100)
    got = token_loss_sum(logits, labels)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, manual.float())
    # against transformers' own mean loss on a packed batch: sum / count == mean
    model, seqs = tiny_llama("sdpa"), sequences()
    batch = collate([dict(input_ids=s, labels=s) for s in seqs], "packed", pad_id=0)
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=None,
                    labels=batch["labels"], use_cache=False)
    torch.testing.assert_close(token_loss_sum(out.logits, batch["labels"]) / batch["num_loss_tokens"], out.loss)


def test_epoch_loss_is_the_same_packed_or_bucketed():
    "Same samples, different layouts and ranks: the summed token loss and token count of an epoch agree."
    model = tiny_llama("sdpa")
    lengths = long_tail(40, seed=5, lo=2, hi=60)
    g = torch.Generator().manual_seed(0)
    data = [dict(input_ids=(ids := torch.randint(1, 100, (n,), generator=g).tolist()),
                 labels=[-100] * (n // 3) + ids[n // 3:]) for n in lengths]
    totals = {}
    for layout in LAYOUTS:
        loss, count = 0.0, 0
        for step in plan_epoch(lengths, 128, 2, layout, seed=0, epoch=0):
            for batch_idx in step:
                b = collate([data[i] for i in batch_idx], layout, pad_id=0)
                with torch.no_grad():
                    logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"],
                                   attention_mask=b["attention_mask"], use_cache=False).logits
                loss += token_loss_sum(logits, b["labels"]).item()
                count += int(b["num_loss_tokens"])
        totals[layout] = (loss, count)
    assert totals["packed"][1] == totals["bucketed"][1] == sum(sum(l != -100 for l in d["labels"][1:]) for d in data)
    assert totals["packed"][0] == pytest.approx(totals["bucketed"][0], rel=1e-5)


# ---------------------------------------------------------------- layout choice

def test_choose_layout_and_attention():
    from transformers.utils import is_flash_attn_2_available
    fa2 = is_flash_attn_2_available()
    assert choose_layout("auto", "cpu") == "bucketed"
    assert choose_layout("auto", "cuda") == ("packed" if fa2 or varlen_available("cuda") else "bucketed")
    assert choose_layout("packed", "cpu") == "packed" and choose_layout("bucketed", "cuda") == "bucketed"
    assert attn_implementation_for("packed", "cpu") == "sdpa"
    assert attn_implementation_for("bucketed", "cuda") == "sdpa"
    assert attn_implementation_for("packed", "cuda") == ("ilab_packed" if varlen_available("cuda") else "flash_attention_2" if fa2 else "sdpa")
    with pytest.raises(ValueError, match="'auto', 'packed', 'bucketed'"):
        choose_layout("pad", "cpu")
