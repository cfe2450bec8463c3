"""leanact.ops.triton.launch: a kernel launched again goes straight to its compiled launcher, with
exactly the arguments Triton's own launch passes it.

Without a GPU, in a process of its own: Triton compiles every kernel for sm_90 and a recording
driver (tests/_fake_triton_driver.py) takes the launches. Every launcher of every op runs once
(its kernels' first launches go through Triton's ``JITFunction.run``), then every recorded launch
is made again with the same objects: each must bypass ``JITFunction.run`` and reach the launcher
with the grid, stream, function, metadata and argument list Triton passed it the first time.
The specialization key is checked where it must split (alignment, integer 1, width, keywords),
and each fallback (launch hooks, argument types it does not model, a launcher that rejects the
list) launches through Triton.
"""
import os
import subprocess
import sys

import pytest

from _triton_run import ROOT

pytestmark = [pytest.mark.triton, pytest.mark.slow]

_SCRIPT = r'''
import collections, sys, warnings
sys.path.insert(0, TESTS)
from _fake_triton_driver import install
launches = install()

import torch
from triton import knobs
from triton.runtime.jit import JITFunction
from leanact.ops.gelu import kernels16 as K
from leanact.ops.triton import launch as L
from _launch_sweep import kernel_names, sweep

runs = collections.Counter()
_run = JITFunction.run
def counting_run(self, *a, **k):
    runs[self.__name__] += 1
    return _run(self, *a, **k)
JITFunction.run = counting_run

def same(a, b):
    """Launcher calls equal: tensors the same objects, everything else equal."""
    if len(a) != len(b):
        return False
    return all((x is y) if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor) else x == y
               for x, y in zip(a, b))

def no_hooks(call):
    """A launcher call with its metadata and hooks (positions 6-8) as None where no hook is installed
    (Triton 3.9 passes its empty hook chains and the metadata it built for them)."""
    hooks = call[7:9]
    assert all(h is None or not getattr(h, "calls", True) for h in hooks), hooks
    return call[:6] + (None, None, None) + call[9:]

bf16 = torch.bfloat16
seen = sweep("cpu")
assert len(launches) == len(seen), (len(launches), len(seen))
kernels = kernel_names()
launched = {k.__name__ for k, *_ in seen}
assert launched == kernels, ("not launched", sorted(kernels - launched))
first = dict(launches=len(launches), runs=sum(runs.values()))

# every launch again, with the same objects: straight to the launcher, with Triton's argument list
runs.clear()
for (kernel, grid, args, kwargs), call in zip(seen, list(launches)):
    before = len(launches)
    L.launch(kernel, grid, *args, **kwargs)
    assert len(launches) == before + 1
    got = launches[-1]
    assert got[6:9] == (None, None, None), got[6:9]
    want = no_hooks(call)
    assert same(got, want), (kernel.__name__, len(got), len(want),
                             [(i, a, b) for i, (a, b) in enumerate(zip(got, want)) if not same((a,), (b,))])
assert not runs, ("through JITFunction.run again", dict(runs))
print("REPLAYED", len(seen), "launches of", len(launched), "kernels; first pass", first)

# the key splits where Triton's specialization does
x = torch.randn(4200, dtype=bf16)
y, bits, table = torch.empty_like(x), torch.empty(4200 // 8, dtype=torch.uint8), torch.zeros(65536, dtype=bf16)
def compiles(start, n):
    """How many launches of the 16-bit GELU forward on x[start:start + n] went through JITFunction.run."""
    runs.clear()
    K.gelu_forward16(x[start:start + n], y[start:start + n], bits, table, 3)
    return runs["_gelu16_fwd_kernel"]
compiles(0, 4096)
assert compiles(0, 4096) == 0
assert compiles(1, 4096) == 1  # 2 bytes in: not 16-byte aligned
assert compiles(1, 4096) == 0
assert compiles(8, 4096) == 0  # 16 bytes in: aligned, the first key
assert compiles(0, 1) == 1  # n == 1: a constant for Triton
assert compiles(0, 17) == 1  # n not divisible by 16
assert compiles(0, 33) == 0
def key(v):
    return L._spec((v,))
assert len({key(1), key(17), key(32), key(2 ** 31), key(2 ** 63)}) == 5
assert key(2 ** 31 + 16) != key(2 ** 31 - 16) and key(0) == key(16) and key(-16) == key(16) != key(-17)
assert key(1.0) == key(2.5) and key(True) != key(False) and key(None) == (None,)
assert key(True) != key(1) and key(False) != key(0) and key(1) != key(2 ** 64 - 1) != key(2 ** 63 + 16)
t = torch.zeros(16)
assert key(t) == key(t[4:]) != key(t[1:]) != key(t.double())

# fallbacks: launch hooks, an argument of another type, a launcher that rejects the list
def hook(metadata):
    pass
chain = knobs.runtime.launch_enter_hook
if hasattr(chain, "add"):
    chain.add(hook)
else:
    knobs.runtime.launch_enter_hook = hook
assert compiles(0, 4096) == 1
if hasattr(chain, "add"):
    chain.remove(hook)
else:
    knobs.runtime.launch_enter_hook = chain
assert compiles(0, 4096) == 0
class Ptr:  # anything with data_ptr() and dtype is a pointer to Triton
    dtype = bf16
    def __init__(self, t):
        self.t = t
    def data_ptr(self):
        return self.t.data_ptr()
runs.clear()
L.launch(K._gelu16_fwd_kernel, (4,), Ptr(x), Ptr(y), bits, Ptr(table), 4096, 3, WITH_BITS=True, BLOCK=1024,
         **K.FUSED)
assert runs["_gelu16_fwd_kernel"] == 1, runs
class Rejecting:  # the first call (the direct launch) rejects its arguments, later ones launch
    def __init__(self, run):
        self.run, self.calls = run, 0
    def __call__(self, *args):
        self.calls += 1
        if self.calls == 1:
            raise TypeError("function takes exactly 99 arguments")
        return self.run(*args)
wrapped = [c for c, *_ in L._COMPILED.values()]
for c in wrapped:
    c._run = Rejecting(c._run)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    assert compiles(0, 4096) == 1  # the direct launch failed, then Triton's
assert any("directly failed" in str(m.message) for m in w), [str(m.message) for m in w]
assert sum(c._run.calls for c in wrapped) == 2
assert L._STATE["on"] is False and not L._COMPILED
assert compiles(0, 4096) == 1  # Triton's launch from now on
print("OK")
'''


def test_direct_launch_matches_triton():
    pytest.importorskip("triton.backends.nvidia.driver")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")
    script = f"TESTS = {os.path.join(ROOT, 'tests')!r}\n" + _SCRIPT
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    if r.returncode != 0 and "ptxas" in r.stderr and "not found" in r.stderr:
        pytest.skip("no ptxas in this Triton install")
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-3000:] + r.stderr[-5000:]


def test_launch_host_benchmark_runs_on_cpu():
    """benchmarks/launch_host.py --cpu: a row per kernel and dtype, both ways timed."""
    pytest.importorskip("triton.backends.nvidia.driver")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "launch_host.py"), "--cpu", "--samples", "1",
                        "--liger"],
                       env=env, capture_output=True, text=True, timeout=900)
    if r.returncode != 0 and "ptxas" in r.stderr and "not found" in r.stderr:
        pytest.skip("no ptxas in this Triton install")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("| _")]
    names = {line.split(" | ")[0][2:] for line in rows}
    assert names >= {"_gelu16_fwd_kernel", "_ln_bwd_kernel", "_gelu32f_bwd_kernel"}, names
    assert len(rows) >= 28 and all(line.endswith("x |") for line in rows), r.stdout
    ops = r.stdout.split("host µs per forward+backward of a lean op")[1]
    for name in ("GELU", "LayerNorm", "RMSNorm", "sub-layer end", "RoPE (q and k)"):
        assert ops.count(f"| {name}") == 2, ops  # bf16 and fp32
    for line in ops.splitlines():  # Liger-Kernel's LayerNorm, RMSNorm, RoPE timed where it imports, else n/a
        if line.startswith(("| LayerNorm", "| RMSNorm", "| RoPE")):
            liger = line.split(" | ")[5]
            assert liger == "n/a" or float(liger) > 0, line


def test_host_stub_with_launches_runs_on_cpu():
    """benchmarks/host_stub.py --launches: a BERT step's kernels compiled for sm_90 and launched into
    the recording driver, every variant timed."""
    pytest.importorskip("triton.backends.nvidia.driver")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "host_stub.py"), "--launches", "--steps", "1"],
                       env=env, capture_output=True, text=True, timeout=900, cwd=os.path.join(ROOT, "benchmarks"))
    if r.returncode != 0 and "ptxas" in r.stderr and "not found" in r.stderr:
        pytest.skip("no ptxas in this Triton install")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "launched into a driver that runs nothing" in r.stdout
    assert r.stdout.count("| leanact") == 3 and "| HF |" in r.stdout, r.stdout
