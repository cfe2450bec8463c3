"""benchmarks/gpu_suite.py without a GPU: its parts' machinery (processes, limits, failures, the
markdown) and the pure helpers. The GPU parts themselves run only on a CUDA machine."""
import importlib.util
import pathlib
import sys

import pytest
import torch

_PATH = pathlib.Path(__file__).parent.parent / "benchmarks" / "gpu_suite.py"
_spec = importlib.util.spec_from_file_location("gpu_suite", _PATH)
suite = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = suite
_spec.loader.exec_module(suite)


def test_limits_fit_in_nine_minutes():
    assert set(suite.LIMITS) == set(suite.PARTS) == set(suite.COLUMNS) and suite.TOTAL_S < 9 * 60


def test_parse_pytest_summary():
    out = "....F.s\nFAILED tests/x.py::t - boom\n3 passed, 1 failed, 2 skipped, 1 error in 4.5s\n"
    assert suite.parse_pytest(out) == {"passed": 3, "failed": 1, "skipped": 2, "error": 1}
    assert suite.parse_pytest("") == {}
    assert suite.parse_pytest("no tests ran in 0.01s") == {}


def test_a_part_that_works_fails_or_hangs_is_reported_and_the_next_still_runs():
    ok = suite.run_part("_selftest_ok", 60)
    assert ok["status"] == "ok" and ok["rows"] == [["first", "1.5"], ["second", "2"]]
    failed = suite.run_part("_selftest_fail", 60)
    assert failed["status"] == "failed" and failed["rows"] == [["first", "1.5"]]
    assert any("RuntimeError: boom" in n for n in failed["notes"])
    hung = suite.run_part("_selftest_hang", 3)
    assert hung["status"] == "timeout" and hung["rows"] == [["first", "1.5"]]  # what it finished is kept
    assert any("limit of 3 s" in n for n in hung["notes"])
    md = suite.markdown({"device": "GPU X", "date": "2030-01-01", "torch": "9.9"},
                        {"_selftest_ok": ok, "_selftest_fail": failed, "_selftest_hang": hung})
    assert md.startswith("## GPU suite — GPU X, 2030-01-01") and "torch 9.9" in md
    assert "### _selftest_ok — ok" in md and "| first | 1.5 |" in md and "| second | 2 |" in md
    assert "### _selftest_fail — failed" in md and "### _selftest_hang — timeout" in md


def test_a_worker_that_dies_without_results():
    res = suite.run_part("_no_such_part", 60)
    assert res["status"] == "failed" and res["notes"]


def test_markdown_of_an_empty_failed_part():
    md = suite.markdown({"device": "d", "date": "x"}, {"ops": {"status": "failed", "notes": ["no CUDA"]}})
    assert "### Per-op forward+backward time (ms, median) — failed" in md and "(no rows)" in md and "- no CUDA" in md


def test_ratios_against_hf_sdpa():
    rows = [("HF sdpa", 20, 100.0), ("leanact", 36, 120.0), ("HF eager", 0, 0.0)]
    r = {m: (rb, rs) for m, rb, rs in suite.bert_ratios(rows)}
    assert r["leanact"] == (1.8, 1.2) and r["HF sdpa"] == (1.0, 1.0) and r["HF eager"] == (0.0, 0.0)
    nan = suite.bert_ratios([("leanact", 3, 1.0)])[0]
    assert nan[1] != nan[1] and nan[2] != nan[2]
    assert suite._cell(float("nan")) == "n/a" and suite._cell(1234.5) == "1234.5" and suite._cell(0.0123456) == "0.0123"


def test_versions_never_raise():
    v = suite.versions()
    assert v["torch"] == torch.__version__ and {"triton", "transformers", "liger_kernel", "commit"} <= set(v)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_without_cuda_it_says_so_and_writes_nothing(tmp_path):
    out = tmp_path / "RESULTS.md"
    with pytest.raises(SystemExit) as exc:
        suite.main(["--out", str(out)])
    assert "needs a CUDA GPU" in str(exc.value.code) and not out.exists()


def test_op_cases_run_forward_and_backward_on_cpu():
    """The ops part's cases (leanact op, torch op) take the same input and give the same outputs
    (elementwise ops: of the input's shape; the MLP case: the down projection's)."""
    for name, dt, shape, lean, ref, liger in suite.op_cases("cpu", tokens=4):
        if dt == "float32" and name.startswith("GELU"):
            continue  # the same calls as bfloat16's; its CPU tables take seconds to build
        torch.manual_seed(0)
        x = torch.randn(shape, dtype=getattr(torch, dt))
        outs = []
        for fn in (lean, ref):
            xi = x.clone().requires_grad_()
            y = fn(xi)
            assert y.dtype == x.dtype and (y.shape == x.shape or name.startswith("SwiGLU")), name
            y.backward(torch.ones_like(y))
            assert xi.grad.shape == x.shape
            outs.append(y.detach())
        assert outs[0].shape == outs[1].shape, name
        if not name.startswith("dropout"):  # (two draws of the mask)
            # the same function computed in fp32 with reductions of up to shape[-1] terms (another
            # order: n·u32), then rounded to the storage dtype (one ulp each side)
            tol = 2 * torch.finfo(x.dtype).eps + shape[-1] * 2.0**-24
            torch.testing.assert_close(outs[0].float(), outs[1].float(), rtol=tol, atol=tol, msg=name)
        assert liger is None


def test_smoke_run_of_every_gpu_part_on_the_cpu(tmp_path):
    """``--smoke``: the GPU parts' code (leanact.patch, the offload plan, leanact.estimate, the batch
    search, the op timings) runs end to end on the CPU at tiny sizes; each part reports "ok" with
    rows, the estimate matches its real CPU step, and the markdown goes to --out only."""
    import os
    import subprocess

    out = tmp_path / "smoke.md"
    parts = ["bert", "llama", "estimate", "offload", "ops"]
    env = dict(os.environ, PYTHONPATH=str(_PATH.parent.parent), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(_PATH), "--smoke", "--parts", *parts, "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    md = out.read_text()
    assert "CPU (smoke run, tiny sizes)" in md
    sections = md.split("\n### ")[1:]
    assert len(sections) == len(parts)
    for name, section in zip(parts, sections):
        assert section.startswith(suite.TITLES[name] + " — ok"), section[:300]
        rows = [ln for ln in section.splitlines() if ln.startswith("| ") and not ln.startswith("| " + suite.COLUMNS[name][0])]
        assert rows, section
    estimate = sections[parts.index("estimate")]
    assert estimate.count("| ok |") == 2, estimate  # estimate(device="cpu") within 5% of the measured step
    offload = sections[parts.index("offload")].splitlines()
    assert int(next(ln for ln in offload if ln.startswith("| leanact + offload")).split("|")[-2]) > 0


def test_smoke_needs_an_out_file_other_than_results_md():
    for argv in (["--smoke"], ["--smoke", "--out", str(_PATH.parent / "RESULTS.md")]):
        with pytest.raises(SystemExit) as exc:
            suite.main(argv)
        assert exc.value.code == 2
