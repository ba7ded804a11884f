"""Real model sizes, checked small: sharded loading from the safetensors files equals the old whole-model path
(first-step loss and gradients, tied embeddings, rotary buffers), the sharded save loads with `from_pretrained`,
the chunked loss equals the full-logits loss, packed attention equals each sequence alone, the preflight's memory
estimate and device query. The CUDA paths are in tests/test_gpu_paths.py."""
import json, os, subprocess, sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from ilab_nb import batching as B
from ilab_nb.launcher import free_port

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def tied_llama(tmp_path_factory):
    "A tiny Llama with tied embeddings and grouped-query attention, saved in bfloat16 (the usual file dtype)."
    d = tmp_path_factory.mktemp("tied")
    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    m.to(torch.bfloat16).save_pretrained(d)
    return d


def test_sharded_load_and_save_equal_the_whole_model_path(tmp_path, tied_llama, demo):
    out_json, out_hf = tmp_path / "r.json", tmp_path / "hf"
    cmd = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()),
           "--log-dir", str(tmp_path / "torchelastic"),          # torch's agent would leave its folder in /tmp
           str(ROOT / "tests" / "sizes_ranks.py"), str(tied_llama), str(demo.model_dir), str(out_json), str(out_hf)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads(out_json.read_text())
    assert res["info"]["load"].startswith("sharded read"), res["info"]
    assert res["tied"] and res["inv_freq_equal"]
    assert res["params_local"] < res["params_total"]                       # each rank holds a shard
    assert abs(res["loss_new"] - res["loss_old"]) <= 1e-5 * abs(res["loss_old"]), res
    worst = max(res["grad_rel_err"].values())
    assert worst < 1e-5, sorted(res["grad_rel_err"].items(), key=lambda kv: -kv[1])[:3]
    # the sharded save is an ordinary Hugging Face folder with the model's weights
    assert (out_hf / "config.json").exists() and not (out_hf / "sharded").exists()
    back = AutoModelForCausalLM.from_pretrained(out_hf, dtype=torch.float32)
    full = torch.load(out_json.with_suffix(".pt"))
    for k, v in back.state_dict().items(): assert torch.equal(v, full[k]), k
    assert back.lm_head.weight is back.model.embed_tokens.weight


def test_chunked_loss_equals_full_logits_loss():
    torch.manual_seed(0)
    h = torch.randn(3, 40, 32, dtype=torch.float64).float().requires_grad_()
    w = (torch.randn(1000, 32) * 0.1).requires_grad_()
    labels = torch.randint(0, 1000, (3, 40)); labels[:, :7] = -100; labels[2, 30:] = -100
    ref = B.token_loss_sum(h @ w.t(), labels); ref.backward()
    gh, gw = h.grad.clone(), w.grad.clone(); h.grad = w.grad = None
    got = B.linear_token_loss_sum(h, w, labels, chunk_tokens=16); got.backward()
    assert abs(float(got.detach() - ref.detach())) <= 1e-5 * abs(float(ref.detach()))
    for a, b in ((h.grad, gh), (w.grad, gw)): assert float((a - b).norm() / b.norm()) < 1e-5


def _packed_vs_alone(device):
    torch.manual_seed(0)
    lm = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)).to(device).eval()
    lm.set_attn_implementation(B.register_packed_attention())
    seqs = [torch.randint(1, 100, (n,)) for n in (7, 31, 2, 18)]
    row = B.collate([dict(input_ids=s, labels=s) for s in seqs], "packed", 0)
    cu, mx = B.packed_seq_info(row["position_ids"])
    with torch.no_grad():
        packed = lm(input_ids=row["input_ids"].to(device), position_ids=row["position_ids"].to(device), use_cache=False,
                    cu_seq_lens_q=cu.to(device), cu_seq_lens_k=cu.to(device), max_length_q=mx, max_length_k=mx).logits[0]
        alone = torch.cat([lm(input_ids=s[None].to(device), use_cache=False).logits[0] for s in seqs])
    return packed.float().cpu(), alone.float().cpu()


def test_packed_attention_equals_each_sequence_alone_on_cpu():
    packed, alone = _packed_vs_alone("cpu")
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)


PREFLIGHT_PROBE = r'''
import inspect, json, sys, torch
from ilab_nb.preflight import preflight, PreflightError
from ilab_nb.config import TrainConfig
calls = []
def trap(name, real):
    def f(*a, **k):
        mods = [fr.frame.f_globals.get("__name__", "") for fr in inspect.stack()[1:]]
        if any(m.startswith("ilab_nb") for m in mods): calls.append(name)
        return real(*a, **k)
    return f
for n in ("is_available", "device_count", "is_bf16_supported", "get_device_name", "get_device_properties",
          "get_device_capability", "mem_get_info", "_lazy_init", "init", "current_device", "set_device"):
    setattr(torch.cuda, n, trap(n, getattr(torch.cuda, n)))
model, data, runs = sys.argv[1:4]
out = {}
for device, precision in (("auto", "fp32"), ("auto", "bf16"), ("cuda", "bf16")):
    try: out[f"{device}/{precision}"] = preflight(TrainConfig(model=model, data=[data], device=device, precision=precision,
                                                              num_processes=1, strategy="single"), runs)["device"]
    except PreflightError as e: out[f"{device}/{precision}"] = "refused: " + str(e)[:80]
print(json.dumps(dict(calls=calls, initialized=torch.cuda.is_initialized(), out=out)))
'''


def test_preflight_never_asks_torch_cuda_in_the_calling_process(tmp_path, demo, small_train):
    r = subprocess.run([sys.executable, "-c", PREFLIGHT_PROBE, str(demo.model_dir), str(small_train), str(tmp_path / "runs")],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["calls"] == [] and res["initialized"] is False, res           # ilab_nb asked torch.cuda nothing here
    if not CUDA:
        assert res["out"]["auto/fp32"] == "cpu" and "bf16" in res["out"]["auto/bf16"] and "refused" in res["out"]["cuda/bf16"], res


def test_memory_estimate_arithmetic_and_refusal(tmp_path):
    from ilab_nb.preflight import check_memory, PreflightError
    from ilab_nb.sizes import count_params, memory_estimate
    from ilab_nb.config import TrainConfig
    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                     num_attention_heads=4, tie_word_embeddings=True))
    m.save_pretrained(tmp_path / "m")
    c = count_params(tmp_path / "m")
    assert c["total"] == sum(p.numel() for p in m.parameters())          # tied embedding counted once
    block = sum(p.numel() for p in m.model.layers[0].parameters())
    assert c["block"] == block and c["root"] == c["total"] - 3 * block
    e = memory_estimate(c, "fsdp", 4, "fp32")
    assert e["per_rank_state"] == 16 * c["total"] // 4 and e["gathered"] == 4 * (c["root"] + 2 * block)
    assert e["device_bytes"] == e["per_rank_state"] + e["gathered"]
    assert memory_estimate(c, "fsdp", 4, "bf16", cpu_offload=True)["device_bytes"] == 2 * (c["root"] + 2 * block)
    small = [dict(index=0, name="tiny GPU", total_bytes=e["device_bytes"], capability=[9, 0])]
    cfg = TrainConfig(model=str(tmp_path / "m"), data=["x"], num_processes=4, device="cuda")
    with pytest.raises(PreflightError, match=r"needs about .* GiB per GPU .* ignore_memory_estimate"):
        check_memory(cfg, "cuda", small)
    assert check_memory(cfg.model_copy(update=dict(ignore_memory_estimate=True)), "cuda", small)["device_bytes"] == e["device_bytes"]
