"""The CUDA paths, checked on a machine without a GPU where their logic can run here, and for real on CUDA (`-m cuda`,
run by `tools/gpu_check.py`): torch's variable-length kernel picked by its signature, packed attention under autocast,
with grouped-query heads and a sliding window, generation from a packed model, the GPU slots under a parent's
`CUDA_VISIBLE_DEVICES`, the benchmark's FLOPs count, the version floors, LoRA's dropout under FSDP's bf16 policy with
gradient checkpointing (one dtype and one mask in the forward and the recompute), and `ddp_timeout` in the nccl group."""
import importlib.util, json, re, sys
from pathlib import Path

import pytest
import torch
import transformers          # its model classes are read when a test needs them: collecting stays quick (`-m cuda --collect-only`)

from ilab_nb import batching as B

ROOT = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="runs CUDA kernels; this machine has no CUDA device (tools/gpu_check.py runs it where one is)")


def _v210(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    "torch 2.10's varlen_attn signature (no scale, no window_size)."
    raise AssertionError("a kernel with torch 2.10's signature must never be called")

def _v211(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)):
    "torch 2.11's signature: a stand-in computed by the reference."
    return B.reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size)


@pytest.mark.parametrize("kernel,usable", [(_v210, False), (_v211, True)])
def test_varlen_kernel_is_chosen_by_its_signature_not_its_import(monkeypatch, kernel, usable):
    "On a GPU machine with torch 2.10, `varlen_attn` imports but has no scale/window_size: auto must not pick it."
    import torch.nn.attention as attention
    fake = type(sys)("torch.nn.attention.varlen"); fake.varlen_attn = kernel
    monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", fake)
    monkeypatch.setattr(attention, "varlen", fake, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert B.varlen_available("cuda") is usable
    assert B.choose_layout("auto", "cuda", "bf16") == ("packed" if usable or B._flash_attn_2_available() else "bucketed")
    assert B.attn_implementation_for("packed", "cuda") == (B.PACKED_ATTENTION if usable else "sdpa")


def _tiny(arch="Llama", **kw):
    torch.manual_seed(0)
    cls, cfg = getattr(transformers, f"{arch}ForCausalLM"), getattr(transformers, f"{arch}Config")
    return cls(cfg(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, **kw)).eval()


def _packed_and_alone(lm, device, lengths=(7, 31, 2, 18), autocast=None):
    seqs = [torch.randint(1, 100, (n,), generator=torch.Generator().manual_seed(n)) for n in lengths]
    row = B.collate([dict(input_ids=s, labels=s) for s in seqs], "packed", 0)
    cu, mx = B.packed_seq_info(row["position_ids"])
    ctx = torch.autocast(device, dtype=torch.bfloat16) if autocast else torch.autocast(device, enabled=False)
    with torch.no_grad(), ctx:
        packed = lm(input_ids=row["input_ids"].to(device), position_ids=row["position_ids"].to(device), use_cache=False,
                    cu_seq_lens_q=cu.to(device), cu_seq_lens_k=cu.to(device), max_length_q=mx, max_length_k=mx).logits[0]
    return packed.float().cpu(), seqs


def test_sliding_window_is_honoured_not_dropped():
    "Mistral's sliding window through packed attention equals sdpa's windowed attention on each sequence alone."
    lm = _tiny("Mistral", sliding_window=4)
    with torch.no_grad(): alone_of = lambda seqs: torch.cat([lm(input_ids=s[None], use_cache=False).logits[0] for s in seqs])
    lm.set_attn_implementation(B.register_packed_attention())
    packed, seqs = _packed_and_alone(lm, "cpu", lengths=(9, 3, 12))
    lm.set_attn_implementation("sdpa")
    alone = alone_of(seqs)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    lm.config.sliding_window = None                  # the window makes a difference here, so the check can fail
    assert not torch.allclose(alone_of(seqs), alone, atol=1e-3)


def _spy(kernel):
    calls = []
    def spy(q, k, v, *a, **kw):
        calls.append((q.dtype, k.dtype, v.dtype, q.shape[1], k.shape[1]))
        return kernel(q, k, v, *a, **kw)
    spy.calls = calls
    return spy


def _kernel_for(device):
    if device == "cpu": return B.reference_varlen_attn
    from torch.nn.attention.varlen import varlen_attn
    return varlen_attn


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, needs_cuda])])
def test_packed_bf16_reaches_the_kernel_and_matches_each_sequence_alone(monkeypatch, device):
    """fp32 weights under bf16 autocast (the single/ddp path) and bf16 weights (FSDP's policy): the kernel gets bf16 q, k, v
    (on CPU the reference stands in for it), and the packed logits equal each sequence alone within bf16's precision."""
    spy = _spy(_kernel_for(device))
    monkeypatch.setitem(B.VARLEN_KERNELS, device, spy)
    lm = _tiny().to(device)
    with torch.no_grad(): alone = torch.cat([lm(input_ids=s[None].to(device), use_cache=False).logits[0].float().cpu()
                                             for s in [torch.randint(1, 100, (n,), generator=torch.Generator().manual_seed(n))
                                                       for n in (7, 31, 2, 18)]])
    lm.set_attn_implementation(B.register_packed_attention())
    packed, _ = _packed_and_alone(lm, device, autocast=True)
    assert [c[:3] for c in spy.calls] == [(torch.bfloat16,) * 3] * 2, spy.calls          # one call per layer, all bf16
    torch.testing.assert_close(packed, alone, atol=0.05, rtol=0.05)                      # bf16 vs float32 logits
    spy.calls.clear()
    packed16, _ = _packed_and_alone(lm.to(torch.bfloat16), device)                       # FSDP's bf16 parameters
    assert [c[:3] for c in spy.calls] == [(torch.bfloat16,) * 3] * 2
    torch.testing.assert_close(packed16, alone, atol=0.1, rtol=0.1)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, needs_cuda])])
def test_generation_from_a_packed_model_with_several_prompts_and_a_cache(monkeypatch, demo, device):
    "eval_prompts on a packed run: two prompts of different lengths, left-padded, KV cache: the same answers as sdpa."
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from ilab_nb.worker import DistEnv, generate_samples
    monkeypatch.setitem(B.VARLEN_KERNELS, device, _kernel_for(device))
    tok = AutoTokenizer.from_pretrained(demo.model_dir)
    m = AutoModelForCausalLM.from_pretrained(demo.model_dir, dtype=torch.float32).to(device)
    env = DistEnv(device=torch.device(device), device_type=device)
    prompts = ["What is the capital of Nutoland?", "Hi", [{"role": "user", "content": "What money do people use in Tarbristan?"}]]
    want = generate_samples(m, tok, prompts, 8, env)
    m.set_attn_implementation(B.register_packed_attention())
    got = generate_samples(m, tok, prompts, 8, env)
    assert got == want and m.config._attn_implementation == B.PACKED_ATTENTION


def test_gpu_slots_follow_the_parent_mask(monkeypatch, tmp_path, demo, small_train):
    """Under CUDA_VISIBLE_DEVICES=2,3 (faked GPU query), a run on visible GPU 1 locks that GPU by its UUID and its
    processes see the machine's GPU 3; bf16 is judged on that GPU only, not on an older GPU 0."""
    from ilab_nb import session as S, preflight as P
    from ilab_nb.launcher import launch_env
    gpus = [dict(index=0, name="Tesla V100", total_bytes=32 * 2**30, capability=[7, 0], uuid="GPU-old"),
            dict(index=1, name="NVIDIA H200", total_bytes=140 * 2**30, capability=[9, 0], uuid="GPU-new")]
    monkeypatch.setattr(P, "query_gpus", lambda force=False: gpus)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    s = S.FineTuneSession(model=str(demo.model_dir), data=str(small_train), device="cuda", devices=[1], num_processes=1,
                          strategy="single", precision="bf16", runs_root=tmp_path / "runs")
    req = s._request()
    assert req["pool"] == ["gpu-GPU-new"] and req["need"] == 1, req
    assert launch_env(tmp_path, req, req["pool"])["CUDA_VISIBLE_DEVICES"] == "3"
    with pytest.raises(P.PreflightError, match=r"Tesla V100 \(GPU 0"):
        S.FineTuneSession(model=str(demo.model_dir), data=str(small_train), device="cuda", num_processes=1,
                          strategy="single", precision="bf16", runs_root=tmp_path / "runs")


def _bench():
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "bench" / "bench_gpu.py")
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("tied", [True, False])
def test_bench_flops_count_the_output_layer_by_hand(tied):
    "The hand count: per layer q 16x16, k and v 16x8, o 16x16, MLP 3x16x32, two norms of 16; a final norm; V x d head."
    bench = _bench()
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied))
    per_layer = 16 * 16 + 2 * 16 * 8 + 16 * 16 + 3 * 16 * 32 + 2 * 16
    n = 2 * per_layer + 16 + 100 * 16                     # the output layer's matrix product counts, tied or not
    assert bench.matmul_params(m) == n
    assert bench.flops_per_token(n, 2, 16, 10.0) == 6 * n + 12 * 2 * 16 * 10.0
    assert bench.peak_for("NVIDIA H200 NVL") == 835e12 and bench.peak_for("NVIDIA H200") == 989e12
    assert bench.peak_for("NVIDIA H100 PCIe") == 756e12 and bench.peak_for("Some GPU") is None


def test_declared_floors_are_the_ones_the_code_checks(monkeypatch):
    "setup.py, README and the runtime check name the same torch floor; an older torch is refused with what needs it."
    from ilab_nb import core
    floor = ".".join(map(str, core.TORCH_FLOOR))
    assert f"'torch>={floor}'" in (ROOT / "setup.py").read_text()
    assert f"torch >= {floor}" in (ROOT / "README.md").read_text()
    monkeypatch.setattr(core, "_installed_version", lambda name: "2.8.0+cu128")
    with pytest.raises(RuntimeError, match=rf"needs torch >= {re.escape(floor)} .*HuggingFaceStorageWriter.* torch 2.8.0"):
        core.require_torch()
    monkeypatch.setattr(core, "_installed_version", lambda name: "2.11.0+cu130")
    core.require_torch()


@pytest.mark.processes
def test_gpu_check_dry_run_runs_every_stage(tmp_path, demo, monkeypatch):
    """The GPU check's CPU form: every stage's code runs (the first run trains, the others are preflighted), one
    summary. Run here, through the `main(argv)` that `python tools/gpu_check.py --dry-run` calls: the check's own
    stages use the torch, transformers and ilab_nb this process has imported (a fresh interpreter's imports: 5.2 CPU-s
    measured), and the suite's demo assets, which the check reuses as a complete demo folder (building them again:
    5.3 CPU-s). The CUDA tests' collection, the run and the bench are still processes of their own, as on a GPU
    machine."""
    from conftest import kill_processes_under
    (tmp_path / "demo").symlink_to(demo.root)           # what `demo_assets(<out>/demo)` finds complete and reuses
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("ILAB_NB_CPU_SLOTS", "2")
    monkeypatch.setenv("ILAB_NB_LOCKS", str(tmp_path / "locks"))     # what main() would set, undone after the test
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec); spec.loader.exec_module(gpu_check)
    try:
        rc = gpu_check.main(["--dry-run", "--out", str(tmp_path)])
    finally:
        kill_processes_under(tmp_path / "runs")
    assert rc == 0, (tmp_path / "summary.md").read_text()[-3000:]
    res = {x["stage"]: x for x in json.loads((tmp_path / "summary.json").read_text())}
    assert [s for s, x in res.items() if x["status"] == "failed"] == []
    assert res["pytest -m cuda"]["collected"] >= 2                          # the CUDA tests exist and collect
    first = res["run: fsdp packed bf16 + eval prompts"]
    assert first["status_of_run"] == "completed" and first["steps"] == 2 and len(first["answers"]) == 2
    assert {x["status"] for s, x in res.items() if s.startswith("run: ") and s != "run: fsdp packed bf16 + eval prompts"} <= \
        {"preflighted", "skipped"}
    assert "MFU" in (tmp_path / "results_gpu.md").read_text() and "| stage | status |" in (tmp_path / "summary.md").read_text()


@pytest.mark.cuda
@needs_cuda
def test_rng_state_is_this_ranks_own_gpu_and_an_old_list_restores():
    "A checkpoint holds its rank's own GPU state; one written with every GPU's (an older version) restores on fewer GPUs."
    from ilab_nb.placement import DistEnv
    from ilab_nb.checkpoints import _rng_state, _set_rng_state
    env = DistEnv(device=torch.device("cuda", 0), device_type="cuda")
    s = _rng_state(env)
    assert isinstance(s["cuda"], torch.Tensor)
    a = torch.rand(3, device="cuda")
    _set_rng_state({**s, "cuda": [s["cuda"]] * (torch.cuda.device_count() + 3)}, env)      # more states than GPUs
    assert torch.equal(torch.rand(3, device="cuda"), a)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, needs_cuda])])
def test_lora_dropout_under_fsdp_bf16_gets_one_dtype_and_one_mask_in_the_recompute(demo, device):
    """LoRA with lora_dropout > 0 and gradient checkpointing under FSDP's bf16 policy, set up as the worker does, on one
    rank: every adapter's dropout gets a bf16 input in the forward and again in the backward's recompute, and draws the
    same mask in both; the adapters' gradients equal those of the same step without checkpointing. (peft's own input
    cast made the first adapter of each block float32 in the forward and bf16 in the recompute, and torch refused the
    step: CheckpointError.)"""
    import torch.distributed as dist
    from ilab_nb.config import TrainConfig
    from ilab_nb.worker import DistEnv, setup_model
    cuda = device == "cuda"
    if cuda: torch.cuda.set_device(0)
    env = DistEnv(backend="nccl" if cuda else "gloo", device=torch.device("cuda", 0) if cuda else torch.device("cpu"), device_type=device)
    dist.init_process_group(env.backend, store=dist.HashStore(), rank=0, world_size=1)
    grads = {}
    try:
        for checkpointing in (True, False):
            cfg = TrainConfig(model=str(demo.model_dir), data=["unused.jsonl"], device=device, num_processes=1, strategy="fsdp",
                              precision="bf16", gradient_checkpointing=checkpointing, lora=dict(r=4, lora_alpha=8, lora_dropout=0.2))
            model, _ = setup_model(cfg, env, "bucketed")
            seen, phase = {}, ["forward"]
            for n, m in model.named_modules():
                if n.endswith("lora_dropout.default"):
                    m.register_forward_hook(lambda mod, i, o, n=n: seen.setdefault(n, []).append((phase[0], i[0].dtype, ((o == 0) & (i[0] != 0)).cpu())))
            ids = torch.randint(3, 100, (2, 24), generator=torch.Generator().manual_seed(1)).to(device)
            torch.manual_seed(0)
            logits = model(input_ids=ids, use_cache=False).logits
            phase[0] = "recompute"
            logits.float().mean().backward()
            grads[checkpointing] = {n: p.grad.full_tensor().float().cpu() for n, p in model.named_parameters() if p.grad is not None}
            want = [("forward", torch.bfloat16), ("recompute", torch.bfloat16)] if checkpointing else [("forward", torch.bfloat16)]
            assert len(seen) == 4 * 7 and all([c[:2] for c in calls] == want for calls in seen.values()), \
                {n: [c[:2] for c in calls] for n, calls in seen.items()}
            if checkpointing: assert all(torch.equal(calls[0][2], calls[1][2]) and calls[0][2].any() for calls in seen.values())
    finally:
        dist.destroy_process_group()
    assert grads[True].keys() == grads[False].keys() and any("lora_B" in n for n in grads[True])
    for n, g in grads[True].items():
        torch.testing.assert_close(g, grads[False][n], rtol=1e-2 if cuda else 0, atol=1e-6 if cuda else 0, msg=n)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("cpu_offload", [False, True])
def test_ddp_timeout_is_the_nccl_groups(monkeypatch, cpu_offload):
    """The run's ddp_timeout reaches the CUDA process group, read back from each of its backends (nccl's own default is
    10 minutes, gloo's 30): through accelerate's PartialState as under torchrun, and in FSDP's group of one."""
    import socket
    import torch.distributed as dist
    from accelerate import PartialState
    from ilab_nb.config import TrainConfig
    from ilab_nb.worker import group_timeout, init_distributed
    want = {"nccl": 1234.0, **({"gloo": 1234.0} if cpu_offload else {})}
    cfg = TrainConfig(model="m", data=["d.jsonl"], device="cuda", num_processes=1, strategy="fsdp", cpu_offload=cpu_offload, ddp_timeout=1234)
    PartialState._reset_state()
    try:
        init_distributed(cfg)                                     # one plain process: FSDP's group of one
        assert group_timeout() == want
        dist.destroy_process_group(); PartialState._reset_state()
        with socket.socket() as s: s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
        for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                         MASTER_PORT=str(port)).items(): monkeypatch.setenv(k, v)
        env = init_distributed(cfg)                               # as one rank of a launch: PartialState's group
        assert env.distributed_type == "MULTI_GPU" and group_timeout() == want
    finally:
        if dist.is_initialized(): dist.destroy_process_group()
        PartialState._reset_state()
