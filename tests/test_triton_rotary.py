"""The RoPE kernel (leanact/ops/rotary/kernels.py) on CPU under Triton's interpreter (setup as
in test_triton_cross_entropy.py; :func:`test_in_subprocess` when this process cannot).

* outputs and gradients bitwise Hugging Face's ``apply_rotary_pos_emb`` and autograd through it
  (sign of zero included) for every pair of tensor / table dtypes, HF's transposed q, per-sample and
  broadcast tables, a ragged number of positions and a head width that is not a power of two;
* a patched Llama through the kernels: loss and every gradient bitwise the same model with the
  rotation left to HF's function, in fp32 and under bf16 autocast, with and without gradient
  checkpointing (reentrant and not); its logits in eval mode under no_grad too;
* the self-check passes, and a kernel one ulp off fails it;
* the kernel compiles for sm_90 (no GPU needed).
"""
import itertools

import pytest
import torch

from _triton_run import compile_for_sm90, interpreter_marks, interpreter_setup, run_interpreted

triton, INTERPRETED = interpreter_setup()

from leanact.ops.rotary import function as R  # noqa: E402
from leanact.ops.triton import dispatch  # noqa: E402

transformers = pytest.importorskip("transformers")
from transformers.models.llama import modeling_llama as ML  # noqa: E402

pytestmark, interp = interpreter_marks(INTERPRETED)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture
def KM(monkeypatch):
    monkeypatch.setenv("LEANACT_TRITON", "1")
    from leanact.ops.rotary import kernels as rotary_kernels
    from leanact.ops.triton import common as kernels

    return kernels, rotary_kernels


def _bitwise(a, b):
    return a.dtype == b.dtype and torch.equal(a, b) and torch.equal(torch.signbit(a), torch.signbit(b))


@interp
@pytest.mark.parametrize("x_dtype,t_dtype", list(itertools.product(DTYPES, DTYPES)))
@pytest.mark.parametrize("tables", [1, 2], ids=["broadcast-tables", "per-sample-tables"])
def test_kernel_is_hf_bitwise(KM, x_dtype, t_dtype, tables):
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(2, 37, 3, 10, generator=g) * 3).to(x_dtype).transpose(1, 2).requires_grad_()
    k = (torch.randn(2, 2, 37, 10, generator=g) * 3).to(x_dtype).requires_grad_()
    cos = torch.randn(tables, 37, 10, generator=g).to(t_dtype)
    sin = torch.randn(tables, 37, 10, generator=g).to(t_dtype)
    cos[0, 0, :4] = torch.tensor([1e-30, -1e-38, 0.0, -0.0]).to(t_dtype)  # subnormal products, signed zeros
    sin[0, 0, :4] = torch.tensor([0.0, -0.0, 1e-30, -1e-39]).to(t_dtype)
    qe, ke = ML.apply_rotary_pos_emb(q, k, cos, sin)
    with dispatch.use_kernels(KM[0]):
        out = R.rotary(q, k, cos, sin)
    assert out is not None
    assert _bitwise(out[0], qe) and _bitwise(out[1], ke) and out[0].stride() == qe.stride()
    gq, gk = (torch.randn(t.shape, generator=g).to(t.dtype) for t in (qe, ke))
    gq[0, 0, 0, :2] = torch.tensor([0.0, -0.0])
    want = torch.autograd.grad((qe, ke), (q, k), (gq, gk))
    with dispatch.use_kernels(KM[0]):
        got = torch.autograd.grad(out, (q, k), (gq, gk))
    assert all(_bitwise(a, b) for a, b in zip(got, want))


@interp
def test_gradients_of_any_layout_and_checks_once_per_call(KM, monkeypatch):
    """The tensors are checked once per call (forward: all four together; backward: only the
    gradients, whose shapes and dtype autograd fixes, both in one launch): a gradient whose last
    dimension is not unit-stride takes the PyTorch path (both gradients then), bitwise autograd's
    still; with unit strides, the kernel."""
    from leanact.ops.rotary import launchers as TR

    g = torch.Generator().manual_seed(0)
    q = (torch.randn(2, 9, 3, 8, generator=g) * 3).to(torch.bfloat16).transpose(1, 2).requires_grad_()
    k = (torch.randn(2, 1, 9, 8, generator=g) * 3).to(torch.bfloat16).requires_grad_()
    cos, sin = torch.randn(1, 9, 8, generator=g), torch.randn(1, 9, 8, generator=g)
    calls = {"usable": 0, "backward_with": 0}
    usable, backward_with = TR.usable, TR.backward_with

    def counted(name, fn):
        def run(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return run

    monkeypatch.setattr(TR, "usable", counted("usable", usable))
    monkeypatch.setattr(TR, "backward_with", counted("backward_with", backward_with))
    for strided in (False, True):
        qe, ke = ML.apply_rotary_pos_emb(q, k, cos, sin)
        gq = torch.randn(qe.shape, generator=g)
        if strided:  # the same values, the last dimension strided
            gq = gq.transpose(-1, -2).contiguous().transpose(-1, -2)
            assert gq.stride(-1) != 1
        want = torch.autograd.grad((qe, ke), (q, k), (gq, torch.zeros_like(ke)))
        calls.update(usable=0, backward_with=0)
        with dispatch.use_kernels(KM[0]):
            out = R.rotary(q, k, cos, sin)
            assert calls["usable"] == 1  # forward: q, k, cos, sin together
            got = torch.autograd.grad(out, (q, k), (gq, torch.zeros_like(ke)))
        assert calls == {"usable": 2, "backward_with": 1}  # backward: both gradients together
        assert all(_bitwise(a, b) for a, b in zip(got, want)), strided


def _llama():
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=100)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


@interp
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("checkpointing", [None, "non-reentrant", "reentrant"])
def test_patched_llama_through_the_kernel(KM, monkeypatch, autocast, checkpointing):
    import leanact
    from leanact.patching import hf_rotary as H

    model = leanact.patch(_llama())
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": checkpointing == "reentrant"})
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    real, calls = H.rotary, []

    def run(fused):
        monkeypatch.setattr(H, "rotary", (lambda *a: calls.append(1) or real(*a)) if fused else (lambda *a: None))
        model.zero_grad()
        with dispatch.use_kernels(KM[0]), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters()]

    fused, plain = run(True), run(False)
    assert calls and all(_bitwise(a, b) for a, b in zip(fused, plain))


@interp
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_patched_llama_eval_and_no_grad_through_the_kernel(KM, monkeypatch, autocast):
    """Inference of a patched Llama (eval mode, no_grad) routes its marked tables to the kernel too:
    logits bitwise the same model with the rotation left to HF's function."""
    import leanact
    from leanact.patching import hf_rotary as H

    model = leanact.patch(_llama()).eval()
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    real, calls = H.rotary, []

    def run(fused):
        monkeypatch.setattr(H, "rotary", (lambda *a: calls.append(1) or real(*a)) if fused else (lambda *a: None))
        with dispatch.use_kernels(KM[0]), torch.no_grad(), \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return model(input_ids=ids).logits

    assert _bitwise(run(True), run(False)) and len(calls) == model.config.num_hidden_layers


@interp
def test_self_check_passes_and_catches_a_wrong_kernel(KM, monkeypatch):
    with dispatch.use_kernels(KM[0]):
        for x_dtype, t_dtype in itertools.product(DTYPES, DTYPES):
            R._check(torch.device("cpu"), (x_dtype, torch.promote_types(x_dtype, t_dtype)))
    real = KM[1].rotary

    def wrong(pairs, *args):  # q's output one ulp off
        real(pairs, *args)
        out = pairs[0][1]
        out[0, 0, 1, 1] = torch.nextafter(out[0, 0, 1, 1], torch.tensor(float("inf"), dtype=out.dtype))

    monkeypatch.setattr(KM[1], "rotary", wrong)
    with dispatch.use_kernels(KM[0]), pytest.raises(AssertionError, match="rotary q_embed"):
        R._check(torch.device("cpu"), (torch.bfloat16, torch.float32))


@pytest.mark.slow
def test_in_subprocess():
    if INTERPRETED:
        pytest.skip("the interpreter runs in this process")
    run_interpreted(__file__)


_COMPILE = r'''
from leanact.ops.rotary import kernels as RK

for x, p in (("bf16", "fp32"), ("bf16", "bf16"), ("fp16", "fp32"), ("fp32", "fp32")):
    for backward in (False, True):
        src, out = (p, x) if backward else (x, p)
        build(RK._rotary_kernel, {"x_ptr": "*" + src, "o_ptr": "*" + out, "y_ptr": "*" + src, "p_ptr": "*" + out,
              "c_ptr": "*" + p, "s_ptr": "*" + p, "H": "i32", "HY": "i32", "BH": "i32", "S": "i32",
              **{n: "i64" for n in ("sxb", "sxh", "sxs", "sob", "soh", "sos", "syb", "syh", "sys_", "spb", "sph",
                                    "sps", "scb", "scs", "ssb", "sss")}},
              {"HALF": 64, "BACKWARD": backward, "P_KIND": {"fp32": 0, "bf16": 1}[p],
               "X_KIND": {"fp32": 0, "bf16": 1, "fp16": 2}[x], "BLOCK_S": 32, "BLOCK_D": 64},
              enable_fp_fusion=False)
'''


@pytest.mark.slow
def test_kernel_compiles_for_a_gpu_without_one():
    compile_for_sm90(_COMPILE)
