"""The kernels' self-checks (each op registers its own, built from leanact/ops/triton/selfcheck.py),
run before an op's kernel first runs on a device: each passes for the real kernels, catches a kernel
that computes something else (which then falls back to the PyTorch path with a warning, or raises
when strict), and leaves the caller's state alone (saved-tensor hooks, autocast, random state). On
CPU tensors under Triton's interpreter (same plumbing as test_triton_kernels.py: in process when
Triton was not imported yet, else in a fresh process).
"""
import warnings

import pytest
import torch

from _triton_run import interpreter_setup  # noqa: E402

triton, INTERPRETED = interpreter_setup()

import leanact.ops.gelu.function as G  # noqa: E402
from leanact.lossy.compress import compress, decompress  # noqa: E402
from leanact.ops.dropout.function import dropout_seeded  # noqa: E402
from leanact.ops.norms.dropout_add_norm import dropout_add_layer_norm  # noqa: E402
from leanact.ops.lossy.fewbit import fewbit_activation  # noqa: E402
from leanact.ops.gated_mlp import gated_down  # noqa: E402
from leanact.ops.norms.layer_norm import layer_norm  # noqa: E402
from leanact.ops.random import keep_mask_like  # noqa: E402
from leanact.ops.norms.rms_norm import rms_norm  # noqa: E402
from leanact.ops.triton import dispatch  # noqa: E402

from _triton_run import run_interpreted  # noqa: E402

pytestmark = [pytest.mark.triton, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore:.*encountered in.*:RuntimeWarning")]
interp = pytest.mark.skipif(not INTERPRETED, reason="Triton imported without the interpreter: see test_in_subprocess")


@pytest.fixture(scope="module")
def K():
    from leanact.ops.triton import common as kernels

    return kernels


@pytest.fixture(autouse=True)
def _default_setting(monkeypatch):
    monkeypatch.delenv("LEANACT_TRITON", raising=False)  # the default: kernels on


def _ops(dtype):
    """Every op with a kernel, forward and backward, on small CPU inputs: what each entry checks."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 300, generator=g).to(dtype).requires_grad_()
    w = (torch.rand(300, generator=g) + 0.5).to(dtype).requires_grad_()
    b = torch.randn(300, generator=g).to(dtype).requires_grad_()
    seed = torch.tensor(5)
    outs = [dropout_seeded(x, seed, 0.2), G.GeluFunction.apply(x, "tanh"),
            layer_norm(x, (300,), w, b, from_output=True), rms_norm(x, (300,), w, from_output=True),
            fewbit_activation(x, "silu", 2), gated_down(x, x * 2, torch.randn(8, 300).to(dtype), kind="silu"),
            dropout_add_layer_norm(x, x.float() * 2, 300, w.float(), b.float(), 1e-5, 0.1)]
    sum(o.float().sum() for o in outs).backward()
    keep_mask_like(seed, (3, 50), 0.1)
    q, s = compress(x.detach().reshape(-1), "fp8", 256)
    decompress(q, s, dtype, 256)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_op_passes_its_self_check(K, dtype):
    with dispatch.use_kernels(K, strict=True, verify=True):
        _ops(dtype)
        done = dispatch.verified()
    names = {name for name, _, _ in done}
    assert names == {"dropout", "gelu", "layer_norm", "rms_norm", "fewbit", "gated_mlp", "compress",
                     "dropout_add_layer_norm"}
    assert ("dropout_add_layer_norm", "cpu", (dtype, torch.float32, torch.float32)) in done
    assert ("dropout", "cpu", torch.int64) in done and ("gelu", "cpu", (dtype, "tanh")) in done
    assert ("compress", "cpu", (dtype, "fp8")) in done


@interp
def test_the_check_runs_once_per_op_and_key(K, monkeypatch):
    calls = []
    real = dispatch._CHECKS["rms_norm"]
    monkeypatch.setitem(dispatch._CHECKS, "rms_norm", lambda device, key: (calls.append(key), real(device, key)))
    x = torch.randn(3, 64, requires_grad=True)
    with dispatch.use_kernels(K, strict=True, verify=True):
        for _ in range(3):
            rms_norm(x, (64,), from_output=False).sum().backward()
        rms_norm(x.detach().bfloat16().requires_grad_(), (64,)).sum().backward()  # (the kernel is the backward's)
    assert calls == [torch.float32, torch.bfloat16]


_KEYS = [("dropout", torch.float32), ("dropout", torch.int64), ("gelu", (torch.bfloat16, "none")),
         ("gelu", (torch.float32, "tanh")), ("layer_norm", torch.bfloat16), ("rms_norm", torch.float32),
         ("gated_mlp", (torch.bfloat16, "gelu_tanh")), ("gated_mlp", (torch.float32, "silu")),
         ("fewbit", (torch.float16, 3)), ("compress", (torch.float32, "int8")), ("compress", (torch.bfloat16, "fp8")),
         ("dropout_add_layer_norm", (torch.bfloat16, torch.float32, torch.float32)),
         ("dropout_add_layer_norm", (torch.bfloat16, torch.bfloat16, torch.bfloat16))]


@interp
def test_checks_never_enter_autograds_engine(K, monkeypatch):
    """A check may start inside a backward pass (autograd's CUDA thread busy with the caller's
    graph): it must not call backward itself, or it would wait on that thread forever."""
    def engine(*args, **kwargs):
        raise AssertionError("a self-check entered autograd's engine")

    monkeypatch.setattr(torch.autograd, "backward", engine)
    monkeypatch.setattr(torch.autograd, "grad", engine)
    with dispatch.use_kernels(K, strict=True, verify=True):
        for name, key in _KEYS:
            assert dispatch._isolated(dispatch._CHECKS[name], torch.device("cpu"), key) is None, (name, key)


@interp
def test_a_check_started_inside_backward(K):
    """The first kernel launch of an op happening in backward (its forward took the PyTorch path)
    runs the check there and the backward completes with the kernel's result."""
    x = torch.randn(3, 200, dtype=torch.bfloat16, requires_grad=True)
    y = G.GeluFunction.apply(x, "none")  # the PyTorch path: kernels not in use yet
    dy = torch.randn_like(y)
    (expected,) = torch.autograd.grad(y, x, dy, retain_graph=True)
    with dispatch.use_kernels(K, strict=True, verify=True):
        (got,) = torch.autograd.grad(y, x, dy)
        assert ("gelu", "cpu", (torch.bfloat16, "none")) in dispatch.verified()
    assert torch.equal(got, expected)


class _Corrupt:
    """A kernels module whose ``name`` launcher writes a slightly wrong value into its output
    (argument ``out``): the self-check must catch it."""

    def __init__(self, module, name, out, shift):
        self.module, self.name, self.out, self.shift = module, name, out, shift

    def __getattr__(self, attr):
        fn = getattr(self.module, attr)
        if attr != self.name:
            return fn

        def corrupt(*args, **kwargs):
            r = fn(*args, **kwargs)
            t = args[self.out]
            t.view(-1)[7] = self.shift(t.view(-1)[7])
            return r
        return corrupt


def _kernel_module(name: str):
    import importlib

    return importlib.import_module(name)


def _layer_norm_dx():
    x = torch.randn(5, 128, requires_grad=True)
    y = layer_norm(x, (128,), torch.ones(128), torch.zeros(128), from_output=True)
    (dx,) = torch.autograd.grad(y, x, torch.randn(5, 128))
    return dx


_CASES = {  # op: (kernel module, launcher, output argument, perturbation, call)
    "dropout": ("leanact.ops.dropout.kernels", "dropout_apply", 1, lambda v: -v + 1,
                lambda: dropout_seeded(torch.randn(2000), torch.tensor(9), 0.3)),
    # dx (the forward is torch's kernel)
    "layer_norm": ("leanact.ops.norms.kernels", "norm_backward", 5, lambda v: v * 1.01 + 0.01,
                   lambda: _layer_norm_dx()),
    "gelu": ("leanact.ops.gelu.kernels16", "gelu_forward16", 1, lambda v: v + 1,
             lambda: G._forward(torch.randn(3000).bfloat16(), "none", True)),
    "gated_mlp": ("leanact.ops.gated_mlp.kernels", "glu_forward", 2, lambda v: v * 1.05,
                  lambda: gated_down(torch.randn(6, 64), torch.randn(6, 64), torch.randn(8, 64))),
    "compress": ("leanact.ops.lossy.kernels", "quantize", 2, lambda v: v * 2,  # a wrong block scale
                 lambda: compress(torch.randn(1000), "int8", 128)),
}


@interp
@pytest.mark.parametrize("op", sorted(_CASES))
def test_a_wrong_kernel_fails_its_check_and_falls_back(K, op):
    where, launcher, out, shift, call = _CASES[op]
    module = _kernel_module(where)
    with dispatch.forced("off"):
        torch.manual_seed(0)
        reference = call()
    bad = _Corrupt(module, launcher, out, shift)
    with dispatch.use_kernels(bad, strict=False, verify=True), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        got = call()
        assert op in dispatch._BROKEN and not any(name == op for name, _, _ in dispatch.verified())
    assert any("failed its self-check" in str(w.message) and op in str(w.message) for w in caught)
    for a, r in zip(*(v if isinstance(v, tuple) else (v,) for v in (got, reference))):
        assert a is None and r is None or torch.equal(a, r)  # the PyTorch path ran
    with dispatch.use_kernels(bad, strict=True, verify=True), pytest.raises(RuntimeError, match="self-check"):
        torch.manual_seed(0)
        call()


class _WrongOverWholeBlocks:
    """The kernels, with a float32 GELU forward whose unmasked kernel (``BLOCK`` divides n: its
    ``EVEN``) is 1% off in one element (the check allows the float32 kernels a few ulps): what the
    suite's sizes run, the check must run too."""

    def __init__(self, module):
        from leanact.ops.gelu import kernels32 as gelu32_kernels

        self.module, self.k32 = module, gelu32_kernels

    def __getattr__(self, attr):
        if attr != "gelu32_forward":
            return getattr(self.k32 if hasattr(self.k32, attr) else self.module, attr)

        def forward(x, y, *args, **kwargs):
            self.k32.gelu32_forward(x, y, *args, **kwargs)
            if x.numel() % self.k32.BLOCK == 0:
                y.view(-1)[7] = y.view(-1)[7] * 1.01 + 0.01
        return forward


@interp
def test_the_float32_gelu_check_runs_the_unmasked_kernel(K):
    bad = _WrongOverWholeBlocks(K)
    x = torch.randn(2048)
    with dispatch.use_kernels(bad, strict=False, verify=True), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y, _ = G._forward(x, "none", True)
        assert "gelu" in dispatch._BROKEN
    assert any("failed its self-check" in str(w.message) for w in caught)
    with dispatch.forced("off"):
        assert torch.equal(y, G._forward(x, "none", True)[0])  # the PyTorch path ran


@interp
def test_the_check_leaves_the_callers_state_alone(K):
    """Saved-tensor hooks, autocast and the random state around the first call see only the op."""
    packed = []

    def pack(t):
        packed.append(tuple(t.shape))
        return t

    x = torch.randn(4, 96, requires_grad=True)
    w = torch.rand(96) + 0.5
    rng = torch.get_rng_state()
    with dispatch.use_kernels(K, strict=True, verify=True):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", torch.bfloat16):
            # the first call: the check runs (in its own thread) when the backward's kernel first launches
            rms_norm(x, (96,), w, from_output=True).sum().backward()
            first = list(packed)
            packed.clear()
            rms_norm(x, (96,), w, from_output=True).sum().backward()
        assert ("rms_norm", "cpu", torch.float32) in dispatch.verified()
    assert first == packed and len(first) >= 1
    assert torch.equal(torch.get_rng_state(), rng)


def test_each_op_registers_its_own_check():
    """Every kernel name has its self-check, registered where the op's PyTorch path lives (the dispatch
    layer and selfcheck.py import no op); importing any part of leanact imports them all."""
    where = {name: check.__module__ for name, check in dispatch._CHECKS.items()}
    assert where == {"dropout": "leanact.ops.dropout.function", "gelu": "leanact.ops.gelu.function",
                     # (the norms' check, made in layer_norm for both)
                     "layer_norm": "leanact.ops.norms.layer_norm", "rms_norm": "leanact.ops.norms.layer_norm",
                     "gated_mlp": "leanact.ops.gated_mlp.function", "fewbit": "leanact.ops.lossy.fewbit",
                     "compress": "leanact.lossy.compress", "cross_entropy": "leanact.ops.cross_entropy.launchers",
                     "dropout_add_layer_norm": "leanact.ops.norms.dropout_add_norm",
                     "rotary": "leanact.ops.rotary.function"}


def test_setting(monkeypatch):
    assert dispatch.enabled()  # unset: on
    for value, on in (("1", True), ("strict", True), ("0", False), (" off ", False)):
        monkeypatch.setenv("LEANACT_TRITON", value)
        assert dispatch.enabled() is on
    monkeypatch.setenv("LEANACT_TRITON", "yes please")
    with pytest.raises(ValueError, match="LEANACT_TRITON='yes please'.*0 \\(the PyTorch path"):
        dispatch.enabled()
    with pytest.raises(ValueError, match="'on' or 'off'"):
        with dispatch.forced("sometimes"):
            pass
    monkeypatch.setenv("LEANACT_TRITON", "0")
    assert not dispatch.enabled()
    monkeypatch.delenv("LEANACT_TRITON")  # read from the environment's mapping at every call: unset again
    assert dispatch.enabled()


def test_setting_with_os_environ_replaced(monkeypatch):
    """A replaced ``os.environ`` (not the mapping read directly) is read the plain way."""
    import os

    monkeypatch.setattr(os, "environ", {"LEANACT_TRITON": "0"})
    assert not dispatch.enabled()
    monkeypatch.setattr(os, "environ", {})
    assert dispatch.enabled()


@pytest.mark.slow
def test_in_subprocess():
    """When this process cannot run the interpreter (see the module doc), run the file in one that can."""
    if INTERPRETED:
        pytest.skip("the interpreter runs in this process")
    run_interpreted(__file__)
