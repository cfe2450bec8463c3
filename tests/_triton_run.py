"""Plumbing shared by the Triton kernel tests (test_triton_kernels.py, test_triton_gated.py,
test_triton_lossy.py).

- :func:`interpreter_setup`: called at a test module's top, before Triton is imported: sets
  ``TRITON_INTERPRET=1`` where this process can run the interpreter.
- :func:`run_interpreted`: run a test file in a fresh process under Triton's interpreter, for when
  the calling process cannot (a CUDA machine, or Triton imported earlier without it).
- :func:`compile_for_sm90`: run a script that builds kernels with ``build(fn, signature, constexprs,
  **options)`` for sm_90 (PTX and cubin, Triton's bundled ptxas) in a fresh process without
  ``TRITON_INTERPRET``: compiler-only errors show up on a machine without a GPU.
"""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

def interpreter_marks(interpreted: bool):
    """``(pytestmark, interp)`` of an interpreter test module: the ``triton`` and ``slow`` marks (the
    interpreter runs a kernel's every program in Python: a module takes 15-60 s on one core) with
    numpy's notes on inf/nan (RuntimeWarning) ignored, and a mark skipping a test where this process
    does not run kernels under the interpreter (the module's ``test_in_subprocess`` runs it again there)."""
    return ([pytest.mark.triton, pytest.mark.slow, pytest.mark.filterwarnings("ignore::RuntimeWarning")],
            pytest.mark.skipif(not interpreted,
                               reason="Triton imported without the interpreter: see test_in_subprocess"))


def interpreting(fresh: bool) -> bool:
    """Whether kernels built in this process run under the interpreter: ``TRITON_INTERPRET=1``, no CUDA
    device, and leanact's kernels either not built yet (``triton.jit`` reads the setting when it
    decorates) or built under the interpreter. ``fresh``: Triton was not imported before the caller
    set the variable (then nothing was built without it)."""
    import torch

    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        return False
    k = sys.modules.get("leanact.ops.triton.common")
    return fresh or k is None or type(k._store).__name__ == "InterpretedFunction"


def interpreter_setup():
    """Skip the calling module without numpy or triton; set ``TRITON_INTERPRET=1`` when Triton was not
    imported yet and there is no CUDA device (it must be set before the first import; conftest.py sets
    it at the start of every test process without CUDA, so that the whole suite shares it). Returns
    ``(triton, whether this process runs kernels under the interpreter)``."""
    import torch

    pytest.importorskip("numpy")
    fresh = "triton" not in sys.modules
    if fresh and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    triton = pytest.importorskip("triton")
    return triton, interpreting(fresh)


_BUILD = r'''
import time
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

def build(fn, sig, consts, **opts):
    full = dict(sig, **{k: "constexpr" for k in consts})
    triton.compile(ASTSource(fn=fn, signature=full, constexprs=consts), target=GPUTarget("cuda", 90, 32), options=opts)

t0 = time.time()
'''


def run_interpreted(test_file: str) -> None:
    """``pytest test_file`` (its compile test left out) with TRITON_INTERPRET=1 and no CUDA device; must pass."""
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", LEANACT_TRITON="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", "not compile",
                        test_file], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def compile_for_sm90(script: str, **env_extra: str) -> None:
    """Run ``script`` (calls to ``build``, see the module doc) in a fresh compiler-mode process; skips
    when this Triton has no ptxas."""
    pytest.importorskip("triton.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=ROOT, **env_extra)
    r = subprocess.run([sys.executable, "-c", _BUILD + script + '\nprint("compiled in %.1f s" % (time.time() - t0))\n'],
                       env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0 and ("ptxas" in r.stderr and "not found" in r.stderr):
        pytest.skip("no ptxas in this Triton install")
    assert r.returncode == 0, r.stderr[-3000:]
