"""device="cuda": plain dropout and SDPA keep what CUDA's kernels keep (leanact.estimate.cuda_kernels),
checked to the byte against formulas."""

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

import leanact
from leanact.estimate.cuda_kernels import sdpa_kernel

B, S, HEADS, D = 2, 48, 4, 16  # s = 48: the efficient kernel's log-sum-exp rows pad to 64


class _Attention(nn.Module):
    """q, k, v made from the input by per-feature scales (their saves are the input and the
    parameters, which the meter does not count), then SDPA."""

    def __init__(self, kv_heads=HEADS, dropout=0.0, attn_dropout=0.0):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3, D))
        self.kv_heads, self.dropout, self.attn_dropout = kv_heads, dropout, attn_dropout

    def forward(self, x, mask=None):
        q = (x * self.w[0]).transpose(1, 2)
        k = (x[:, :, :self.kv_heads] * self.w[1]).transpose(1, 2)
        v = (x[:, :, :self.kv_heads] * self.w[2]).transpose(1, 2)
        q = F.dropout(q, self.dropout, self.training)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.attn_dropout,
                                             enable_gqa=self.kv_heads != HEADS)
        return out.float().sum()


def _saved(module, dtype, mask=None, device="cuda"):
    x = torch.randn(B, S, HEADS, D, dtype=dtype)
    inputs = (x,) if mask is None else (x, mask)
    return leanact.estimate(module.to(dtype), inputs, device=device, loss_fn=lambda out, _: out, optimizer=None).saved


def test_flash_keeps_qkv_out_lse_and_rng_state():
    n = B * S * HEADS * D * 2  # one bf16 (b, s, heads, d) tensor
    assert sdpa_kernel(torch.empty(B, HEADS, S, D, dtype=torch.bfloat16), *[torch.empty(B, HEADS, S, D)] * 2,
                       None) == "flash"
    lse, rng = B * HEADS * S * 4, 16 + 8
    assert _saved(_Attention(), torch.bfloat16) == 4 * n + lse + rng
    # GQA (enable_gqa): k, v at the key/value heads' count
    assert _saved(_Attention(kv_heads=2), torch.bfloat16) == 2 * n + 2 * (n // 2) + lse + rng


def test_efficient_keeps_the_bias_and_padded_lse():
    mask = torch.ones(B, 1, S, S, dtype=torch.bool).tril()
    n, lse = B * S * HEADS * D, B * HEADS * 64 * 4
    bias = B * S * S  # the bool mask turned into a tensor of q's dtype (the mask itself is an input)
    assert _saved(_Attention(), torch.bfloat16, mask) == 4 * n * 2 + lse + bias * 2
    assert _saved(_Attention(), torch.float32) == 4 * n * 4 + lse  # fp32: no flash
    # attention dropout: the efficient kernel draws from its RNG state (host scalars): nothing more kept
    assert _saved(_Attention(attn_dropout=0.1), torch.float32) == 4 * n * 4 + lse


def test_dropout_keeps_a_bool_mask_on_cuda():
    n = B * S * HEADS * D
    base = _saved(_Attention(), torch.float32)
    assert _saved(_Attention(dropout=0.1), torch.float32) - base == n  # bool mask, 1 byte
    cpu = _saved(_Attention(), torch.float32, device="cpu")
    assert _saved(_Attention(dropout=0.1), torch.float32, device="cpu") - cpu == 4 * n  # the CPU's fp32 mask


def test_kernel_choice():
    half, full = torch.empty(B, HEADS, S, D, dtype=torch.bfloat16), torch.empty(B, HEADS, S, D)
    kv_half, kv_full = torch.empty(B, 2, S, D, dtype=torch.bfloat16), torch.empty(B, 2, S, D)
    mask = torch.ones(S, S, dtype=torch.bool)
    assert sdpa_kernel(half, half, half, mask) == "efficient"
    assert sdpa_kernel(full, full, full, None) == "efficient"
    assert sdpa_kernel(half, kv_half, kv_half, None, enable_gqa=True) == "flash"
    assert sdpa_kernel(full, kv_full, kv_full, None, enable_gqa=True) == "math"
    big = torch.empty(B, HEADS, S, 512, dtype=torch.bfloat16)
    assert sdpa_kernel(big, big, big, None) == "efficient"


def _llama(dtype):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=172, vocab_size=100, max_position_embeddings=128,
                                   attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg).to(dtype)


def _bert(hidden_dropout):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
                                  vocab_size=100, hidden_dropout_prob=hidden_dropout, attn_implementation="sdpa")
    return transformers.BertForMaskedLM(cfg).to(torch.bfloat16)


def _ids(mask=False):
    ids = torch.randint(3, 100, (B, S))
    x = dict(input_ids=ids, labels=ids)
    if mask:
        x["attention_mask"] = torch.ones_like(ids)
        x["attention_mask"][1, S // 2:] = 0
    return x


@pytest.mark.slow
def test_llama_flash_layer():
    """Tiny LLaMA, bf16, no padding: Hugging Face passes is_causal=True (not a mask, in the trace as
    for real inputs) and the flash kernel keeps what the CPU flash kernel keeps plus its RNG state."""
    model, x = _llama(torch.bfloat16), _ids()
    cuda = leanact.estimate(model, x, device="cuda").per_layer["model.layers.1"]
    cpu = leanact.estimate(model, x, device="cpu").per_layer["model.layers.1"]
    assert cuda - cpu == 16 + 8
    # with padding: the efficient kernel (no GQA: Hugging Face repeats k, v to the query heads), its
    # bf16 bias (b, 1, s, s) and padded log-sum-exp, no RNG state
    padded = leanact.estimate(model, _ids(mask=True), device="cuda").per_layer["model.layers.1"]
    lse = B * HEADS * 64 * 4 - B * HEADS * S * 4
    repeated = 2 * B * (HEADS - 2) * S * D * 2
    assert padded - cuda == B * S * S * 2 + lse - 24 + repeated


@pytest.mark.slow
def test_bert_layer():
    """Tiny BERT, bf16: two hidden dropouts per layer keep bool masks (b, s, h); the padding mask
    makes the efficient kernel keep a bf16 bias instead of the flash kernel's RNG state."""
    x = _ids(mask=True)
    with_dropout = leanact.estimate(_bert(0.1), x, device="cuda").per_layer["bert.encoder.layer.1"]
    without = leanact.estimate(_bert(0.0), x, device="cuda").per_layer["bert.encoder.layer.1"]
    assert with_dropout - without == 2 * B * S * 64
    unpadded = leanact.estimate(_bert(0.1), _ids(), device="cuda").per_layer["bert.encoder.layer.1"]
    assert with_dropout - unpadded == B * S * S * 2 + (B * HEADS * 64 * 4 - B * HEADS * S * 4) - 24


@pytest.mark.slow
def test_sdpa_under_autocast_runs_in_the_low_dtype():
    """Under autocast CUDA runs SDPA in 16 bits (its autocast list) even when q arrives in fp32 (LLaMA's
    rotary embedding promotes it): the flash kernel, no s x s tensor. A tiny LLaMA layer then keeps
    less under fp32 + bf16 autocast than in fp32 (before the cast was modelled it kept more: the
    fp32 math path's probabilities)."""
    cfg = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=512, num_hidden_layers=2, vocab_size=1000,
                                   attn_implementation="sdpa")
    ids = torch.zeros(1, 256, dtype=torch.long)
    kept = {}
    for ac in (False, "bf16"):
        est = leanact.estimate_config(cfg, dict(input_ids=ids, labels=ids), model_class=transformers.LlamaForCausalLM,
                                      autocast=ac, device="cuda")
        kept[ac] = est.per_layer["model.layers.1"]
    s2_fp32 = 4 * 256 * 256 * 4  # one fp32 (b, H, s, s) tensor
    assert kept["bf16"] < kept[False] - s2_fp32, kept


@pytest.mark.slow
def test_patched_attention_takes_the_gpu_path(monkeypatch):
    """On a GPU leanact's attention (dropout 0, bf16) is SDPA's flash kernel, on a CPU in bf16 the
    recompute core: estimate(device="cuda") traces the GPU's path on its fake CPU tensors."""
    import leanact.ops.attention.core as core

    calls = []
    apply = core.RecomputeAttention.apply
    monkeypatch.setattr(core.RecomputeAttention, "apply", lambda *a: calls.append(1) or apply(*a))
    model = _llama(torch.bfloat16)
    leanact.patch(model)
    cuda = leanact.estimate(model, _ids(), device="cuda").per_layer["model.layers.1"]
    assert calls == []
    cpu = leanact.estimate(model, _ids(), device="cpu").per_layer["model.layers.1"]
    assert len(calls) >= 2  # one per layer
    # flash keeps its output (which the output projection keeps anyway: the same storage) and its
    # RNG state (16 + 8 bytes); the core keeps neither
    assert cuda - cpu == 16 + 8


def test_memory_tracker_does_not_materialise_the_fused_logits():
    """A memory tracker (torch's MemTracker, which the estimate runs) asks every module output for
    its storage: the head's placeholder answers with its own one element, not the real logits."""
    from torch.distributed._tools.mem_tracker import MemTracker

    model = _llama(torch.float32).train()
    leanact.patch(model)
    with MemTracker() as tracker:
        tracker.track_external(model)
        out = model(**_ids())
        out.loss.backward()
    state = leanact.summary(model).loss_states[""]
    assert out.logits is None and state.fused_calls == 1 and state.fallbacks == {}


@pytest.mark.slow
def test_estimate_of_the_patched_head_counts_no_logits():
    """Twice the tokens add far less than their logits to the step's peak: the fused loss never
    materialises them (the trace used to, when the memory tracker asked the head's output)."""
    def peak_at(vocab, seq):
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=172, vocab_size=vocab,
                                       max_position_embeddings=512, attn_implementation="sdpa")
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
        leanact.patch(model)
        ids = torch.zeros(1, seq, dtype=torch.long)
        return leanact.estimate(model.train(), dict(input_ids=ids, labels=ids), device="cuda")

    short, longer = peak_at(8192, 256), peak_at(8192, 512)
    logits = 256 * 8192 * 2  # the bf16 logits of the 256 tokens more
    assert longer.peak - short.peak < logits // 2


# -- what the CUDA runtime holds across steps (leanact.estimate.cuda_runtime) ----------------------

MIB = 2**20


class _Linear(nn.Module):
    """x @ W^T + b (cuBLASLt's bias epilogue on CUDA) in forward, two plain matmuls in backward."""

    def __init__(self, bias=True):
        super().__init__()
        self.fc = nn.Linear(32, 32, bias=bias)

    def forward(self, x):
        return self.fc(x).float().sum()


class _Scale(nn.Module):
    """No matmul anywhere: no cuBLAS handle, no workspace."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(32))

    def forward(self, x):
        return (x * self.w).float().sum()


def _step(module, device="cuda", **kw):
    x = torch.randn(64, 32, dtype=torch.bfloat16)
    return leanact.estimate(module.to(torch.bfloat16), (x,), device=device, loss_fn=lambda out, _: out, **kw)


def test_cublas_workspace_per_thread_that_runs_matmuls(monkeypatch):
    """Forward (caller's thread) and backward (autograd's worker) each hold a cuBLAS workspace, 32 MiB
    on Hopper; cuBLASLt's bias epilogue a separate 1 MiB one where torch does not share them; all
    held from the first step on, so they add to the peak as they are."""
    monkeypatch.setenv("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "0")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    est = _step(_Linear())
    assert est.workspace_items == {"cuBLAS workspace (backward thread)": 32 * MIB,
                                   "cuBLAS workspace (forward thread)": 32 * MIB,
                                   "cuBLASLt workspace (forward thread)": 1 * MIB}
    assert est.workspaces == est.at_peak["Workspace"] == 65 * MIB
    assert est.peak == est.at_peak["Total"] == sum(v for k, v in est.at_peak.items() if k != "Total")
    cpu = _step(_Linear(), device="cpu")
    assert cpu.workspaces == 0 and cpu.workspace_items == {} and "Workspace" not in cpu.at_peak
    assert est.temporaries == est.peak - est.workspaces - sum(
        est.at_peak.get(k, 0) for k in ("Parameter", "Buffer", "Optstate", "Activation", "Gradient"))
    # no bias: a plain matmul, no cuBLASLt; shared workspaces (torch >= 2.12's default): none either
    assert "cuBLASLt workspace (forward thread)" not in _step(_Linear(bias=False)).workspace_items
    monkeypatch.setenv("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "1")
    assert _step(_Linear()).workspaces == 64 * MIB
    # no matmul at all: nothing
    assert _step(_Scale()).workspaces == 0


def test_cublas_workspace_size_follows_the_config_and_the_gpu(monkeypatch):
    from leanact.estimate import cuda_runtime

    monkeypatch.setenv("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "1")
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the deterministic setting: 8 x 16 KiB
    assert _step(_Linear()).workspaces == 2 * 8 * 16 * 1024
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2:16:8")
    assert cuda_runtime.cublas_workspace_bytes() == 2 * 4096 * 1024 + 8 * 16 * 1024
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    ampere = cuda_runtime.GPU((8, 0), 108)
    assert cuda_runtime.cublas_workspace_bytes(ampere) == 2 * 4096 * 1024 + 8 * 16 * 1024
    assert cuda_runtime.cublas_workspace_bytes(cuda_runtime.GPU((9, 0), 132)) == 32 * MIB
    monkeypatch.setattr(cuda_runtime, "target", lambda: ampere)
    assert _step(_Linear()).workspaces == 2 * (2 * 4096 * 1024 + 8 * 16 * 1024)


@pytest.mark.slow
def test_gelu_tables_live_on_the_device(monkeypatch):
    """A patched model's GELU reads its 16-bit lookup tables (forward: GELU of every bf16 pattern;
    backward: the fp32 derivative of both branches) from device memory, built on its first step."""
    monkeypatch.setenv("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "1")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    model = leanact.patch(_bert(0.1))
    est = leanact.estimate(model, _ids(), device="cuda")
    tables = {k: v for k, v in est.workspace_items.items() if k.startswith("GELU")}
    assert tables == {"GELU table y16 bfloat16 none": 2**16 * 2, "GELU table g16 bfloat16 none": 2**17 * 4}
    assert est.workspaces == 64 * MIB + 2**17 + 2**19
    assert not any(k.startswith("GELU") for k in leanact.estimate(_bert(0.1), _ids(), device="cuda").workspace_items)


@pytest.mark.slow
def test_float32_gelu_tables_live_on_the_device(monkeypatch):
    """A float32 model's GELU reads the CUDA float32 kernels' tables from device memory: the erf
    forward's (8,192 cubics) and the backward's (4,096), 16 bytes each; the tanh form has no forward
    table."""
    monkeypatch.setenv("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "1")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    for act, expected in (("gelu", {"GELU table erfcx32 float32 none": 8192 * 16,
                                    "GELU table slope32 float32 none": 4096 * 16}),
                          ("gelu_new", {"GELU table slope32 float32 tanh": 4096 * 16})):
        torch.manual_seed(0)
        cfg = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=256, vocab_size=100, hidden_act=act, attn_implementation="sdpa")
        model = leanact.patch(transformers.BertForMaskedLM(cfg))
        est = leanact.estimate(model, _ids(), device="cuda")
        assert {k: v for k, v in est.workspace_items.items() if k.startswith("GELU")} == expected


def test_norm_backward_partials_per_sm(monkeypatch):
    """On CUDA the norms' backward spreads the rows over 4 programs per SM, each summing a float32
    row of dγ and of dβ: (4·SMs, n) float32 each, for the modelled GPU (fake tensors sit on the CPU)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from leanact.estimate import cuda_runtime
    from leanact.ops import fake_rules

    from leanact.ops.norms import launchers as norms

    monkeypatch.setattr(cuda_runtime, "target", lambda: cuda_runtime.GPU((9, 0), 10))
    with FakeTensorMode(), fake_rules.rules(fake_rules.FakeRun("cuda", sms=cuda_runtime.target().sms)):
        y = torch.empty(4, 300, 64, dtype=torch.bfloat16)
        _, dw, db = norms._grad_outputs(y, y, 64, True, True, True)
        assert dw.shape == db.shape == (40, 64) and dw.dtype == db.dtype == torch.float32
        few = torch.empty(3, 64, dtype=torch.bfloat16)
        assert norms._grad_outputs(few, few, 64, False, True, False)[1].shape == (3, 64)  # never more than rows
        assert norms._grad_outputs(y, y, 64, True, True, False, 2)[1].shape == (20, 64)  # RMSNorm's 2 per SM
        assert norms._grad_outputs(y, y, 64, True, False, False)[1:] == (None, None)  # γ, β frozen: no partials
    assert norms._programs(4096, torch.device("cpu")) == 4  # real CPU tensors: untouched (4 programs per "SM")
    monkeypatch.setattr(norms, "PROGRAMS_PER_SM", 8)  # the count the backward and the estimate share
    with FakeTensorMode(), fake_rules.rules(fake_rules.FakeRun("cuda", sms=cuda_runtime.target().sms)):
        y = torch.empty(4, 300, 64, dtype=torch.bfloat16)
        assert norms._grad_outputs(y, y, 64, True, True, True)[1].shape == (80, 64)
    assert norms._programs(4096, torch.device("cpu")) == 8


def test_each_norm_backward_allocates_its_own_program_count(monkeypatch):
    """Through the launchers (what leanact.estimate runs on fake tensors): LayerNorm's backward sums
    its partials over PROGRAMS_PER_SM programs per SM, RMSNorm's over RMS_PROGRAMS_PER_SM, and with
    γ, β frozen neither allocates partials."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from leanact.estimate import cuda_runtime
    from leanact.ops import fake_rules
    from leanact.ops.norms import launchers as norm

    monkeypatch.setattr(cuda_runtime, "target", lambda: cuda_runtime.GPU((9, 0), 10))
    monkeypatch.setattr(norm, "PROGRAMS_PER_SM", 3)
    monkeypatch.setattr(norm, "RMS_PROGRAMS_PER_SM", 5)
    partials = []
    real = norm._grad_outputs

    def recording(*args, **kwargs):
        out = real(*args, **kwargs)
        partials.append(tuple(None if t is None else tuple(t.shape) for t in out[1:]))
        return out

    monkeypatch.setattr(norm, "_grad_outputs", recording)
    with FakeTensorMode(), fake_rules.rules(fake_rules.FakeRun("cuda", sms=cuda_runtime.target().sms)):
        y, w, b = torch.empty(300, 64), torch.empty(64), torch.empty(64)
        rstd = torch.empty(300, 1)
        assert norm.layer_norm_backward(y, y, rstd, w, b, (64,), (True, True, True)) is not None
        assert norm.rms_norm_backward(y, y, rstd, w, 64, True, True, True) is not None
        assert norm.layer_norm_backward(y, y, rstd, w, b, (64,), (True, False, False)) is not None
        assert norm.rms_norm_backward(y, y, rstd, w, 64, True, True, False) is not None
    assert partials == [((30, 64), (30, 64)), ((50, 64), None), (None, None), (None, None)]


@pytest.mark.slow
def test_fused_loss_multiplies_as_on_the_gpu(monkeypatch):
    """The fused loss picks its matmuls from the tensors' device: the estimate of a CUDA step does
    not depend on the host CPU (16-bit GEMM or not) nor on what ran before in the process (a real
    CPU call that found no fp32-output addmm)."""
    import leanact.ops.cross_entropy.function as lce

    monkeypatch.setenv("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "1")
    model = leanact.patch(_llama(torch.bfloat16))
    base = leanact.estimate(model, _ids(), device="cuda")
    monkeypatch.setattr(lce, "_native_16bit_gemm", lambda dtype: False)
    monkeypatch.setattr(lce, "_FP32_ADDMM", {"cpu": False})
    again = leanact.estimate(model, _ids(), device="cuda")
    assert again.peak == base.peak and again.at_peak == base.at_peak


@pytest.mark.parametrize("dtype,padded", [(torch.float32, False), (torch.bfloat16, True)])
def test_patched_gqa_never_runs_cuda_math_attention(dtype, padded):
    """CUDA's SDPA takes grouped-query attention fused only in its flash kernel (fp16/bf16, no mask):
    fp32 or a padding mask would send it to the math path, which keeps s² scores. leanact's attention
    then runs its own core instead: the step grows linearly in the sequence, not quadratically."""
    cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=128, vocab_size=100, max_position_embeddings=4096)
    with torch.device("meta"):
        model = leanact.patch(transformers.LlamaForCausalLM(cfg).to(dtype)).train()

    def peak(s):
        ids = torch.zeros(1, s, dtype=torch.long)
        x = dict(input_ids=ids, labels=ids)
        if padded:
            x["attention_mask"] = torch.ones_like(ids)
            x["attention_mask"][0, :7] = 0
        return leanact.estimate(model, x, device="cuda").peak

    p1, p2, p4 = peak(1024), peak(2048), peak(4096)
    # the math path would keep 4 heads x s² fp32 scores: 64 MiB at s = 2048, 256 MiB at 4096; padding's
    # own (b, 1, s, s) bool mask (Hugging Face's, one byte per entry) is the only s² term allowed
    mask = (4096**2 - 2 * 2048**2 + 1024**2) if padded else 0
    assert p4 - p2 <= 2 * (p2 - p1) + mask + (1 << 20), (p1, p2, p4)
