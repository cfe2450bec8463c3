"""Every Triton kernel of leanact launched through its op's launchers, each launch recorded as
``(kernel, grid, args, kwargs)``: what tests/test_triton_launch.py replays and
benchmarks/launch_host.py times. On CPU tensors the kernels must be compiled ones with a driver that
takes the launches (tests/_fake_triton_driver.py); on a CUDA device they run.
"""
from __future__ import annotations

import contextlib

import torch

from leanact.ops.triton import dispatch
from leanact.ops.dropout import launchers as td
from leanact.ops.cross_entropy import launchers as tce
from leanact.ops.gated_mlp import launchers as tgd
from leanact.ops.lossy import launchers as tlo
from leanact.ops.gelu import launchers as tg
from leanact.ops.norms import launchers as tn
from leanact.ops.rotary import launchers as tr

#: The modules holding the kernels (each launches through its module-level name ``launch``).
MODULES = ("leanact.ops.dropout.kernels", "leanact.ops.norms.kernels", "leanact.ops.gelu.kernels16",
           "leanact.ops.gelu.kernels32", "leanact.ops.gated_mlp.kernels", "leanact.ops.lossy.kernels",
           "leanact.ops.rotary.kernels", "leanact.ops.cross_entropy.kernels")


def modules():
    import importlib

    return [importlib.import_module(m) for m in MODULES]


def kernel_names() -> set[str]:
    """Every kernel of those modules (``_*_kernel``)."""
    return {n for m in modules() for n in vars(m) if n.startswith("_") and n.endswith("_kernel")}


@contextlib.contextmanager
def recording(seen: list):
    """Within the block, every launch of those modules is appended to ``seen`` (then made)."""
    mods = modules()
    saved = [m.launch for m in mods]
    real = saved[0]

    def spy(kernel, grid, *args, **kwargs):
        seen.append((kernel, grid, args, kwargs))
        return real(kernel, grid, *args, **kwargs)

    for m in mods:
        m.launch = spy
    try:
        yield seen
    finally:
        for m, f in zip(mods, saved):
            m.launch = f


def sweep(device: str = "cpu", dtypes=(torch.bfloat16, torch.float16, torch.float32)) -> list:
    """Run every op's launchers once per dtype on small tensors; returns the launches made."""
    seen: list = []
    from leanact.ops.triton import common as kernels

    fp32 = torch.float32
    with dispatch.use_kernels(kernels, strict=True), recording(seen), torch.device(device):
        seed = torch.tensor(1234, dtype=torch.int64)
        thr = 3 << 28
        for dt in dtypes:
            x = torch.randn(4, 300, dtype=dt)
            dy = torch.randn_like(x)
            for a in ("none", "tanh"):
                y, bits = tg.gelu_forward(x, a, True)
                tg.gelu_backward(y, bits, dy, a)
            w, b = torch.ones(300, dtype=dt), torch.zeros(300, dtype=dt)
            y, rstd = tn.layer_norm_forward(x, (300,), w, b, 1e-5)
            tn.layer_norm_backward(dy, y, rstd.float(), w, b, (300,), (True, True, True))
            y, rstd = tn.rms_norm_forward(x, (300,), w, 1e-6)
            tn.rms_norm_backward(dy, y, rstd, w, 300, True, True, True)
            tn.rms_norm_backward(dy, x, rstd, w, 300, False, True, True)
            r = torch.randn(4, 300, dtype=fp32)
            y, rstd = tn.dropout_add_layer_norm_forward(x, r, (300,), w.float(), b.float(), 1e-5, seed, thr, 1.1,
                                                        fp32, fp32)
            tn.dropout_add_layer_norm_backward(dy.float(), y, rstd.float(), w.float(), b.float(), (300,), seed, thr,
                                               1.1, fp32, dt, fp32, (True, True, True, True))
            td.dropout(x, seed, thr, 1.1, False)
            g, u = torch.randn(6, 256, dtype=dt), torch.randn(6, 256, dtype=dt)
            for kind in ("silu", "gelu", "gelu_tanh"):
                tgd.glu_forward(g, u, kind)
                tgd.glu_backward(g, u, torch.randn_like(g), kind, True, True, True)
            q = torch.randn(2, 8, 4, 64, dtype=dt).transpose(1, 2)  # HF's (b, s, h, d) as (b, h, s, d)
            cos, sin = torch.randn(2, 8, 64), torch.randn(2, 8, 64)
            tr.rotary_backward(tr.rotary_forward(q, cos, sin), cos, sin, dt)
            z = torch.randn(5, 1000, dtype=dt)
            tgt = torch.randint(0, 1000, (5,))
            lse, zy, zs = torch.empty(5), torch.empty(5), torch.empty(5)
            tce.chunk_(z, tgt, None, lse, zy, zs, 1.0, None, 0.1, True, False)
            tce.chunk_(z, tgt, torch.ones(5), lse, zy, None, 1.0, 30.0, 0.0, False, True)
            borders, labels = torch.tensor([-1.0, 0.0, 1.0]), torch.tensor([0, 1, 2, 3], dtype=torch.uint8)
            y_table = torch.zeros(65536, dtype=dt)
            packed = tlo.fewbit_forward(x, lambda: (borders, labels), 2, lambda: y_table)[1]
            tlo.fewbit_backward(packed, torch.randn(4), dy, 2)
            flat = x.reshape(-1)
            blocks = -(-flat.numel() // 256)
            v, s = tlo.compress_8bit(flat, False, 256, 127.0, torch.rand(blocks * 256))
            tlo.decompress_8bit(v, s, dt, 256)
            v, s = tlo.compress_8bit(flat, True, 256, 448.0, None)
            tlo.decompress_8bit(v, s, dt, 256)
        td.keep_mask_like(seed, (3, 700), thr, seed.device, 5)
        td.keep_mask_rows(seed, torch.tensor([0, 900, 1800]), 700, thr)
    return seen
