"""benchmarks/gpu_suite.py without a GPU: its parts' machinery (processes, limits, failures, the
markdown) and the pure helpers. The GPU parts themselves run only on a CUDA machine."""
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import pathlib
import subprocess
import sys
import types

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
    assert v["torch"] == torch.__version__ and {"triton", "transformers", "liger-kernel", "commit"} <= set(v)


def test_liger_version_comes_from_its_distribution(monkeypatch):
    """liger_kernel has no ``__version__`` (the H200 run's header said "liger_kernel ?"): the
    distribution's version; "not installed" when neither imports nor is installed."""
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))  # no __version__
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda d: "0.8.5" if d == "liger-kernel" else real(d))
    v = suite.versions()
    assert v["liger-kernel"] == "0.8.5"
    assert "liger-kernel 0.8.5" in suite.markdown({"device": "d", "date": "x", **v}, {})
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # import fails

    def missing(d):
        raise importlib.metadata.PackageNotFoundError(d)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert suite.versions()["liger-kernel"] == "not installed"


def _git(cwd, *args):
    return subprocess.run(["git", "-C", str(cwd), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          capture_output=True, text=True, timeout=30)


def test_commit_is_the_leanact_packages_checkout(tmp_path, monkeypatch):
    """The header's commit is that of the checkout tracking the leanact package that runs, whatever
    the working directory's repository; "unknown" for a copy outside a checkout or one its
    enclosing repository does not track."""
    import leanact

    pkg = pathlib.Path(leanact.__file__).parent
    other = tmp_path / "other"
    other.mkdir()
    assert _git(other, "init", "-q").returncode == 0 and _git(other, "commit", "-q", "--allow-empty", "-m", "x").returncode == 0
    monkeypatch.chdir(other)  # another repository as the working directory
    if _git(pkg, "ls-files", "--error-unmatch", "__init__.py").returncode == 0:
        assert suite.versions()["commit"] == _git(pkg, "rev-parse", "--short", "HEAD").stdout.strip()
    for copy in (tmp_path / "copy" / "leanact", other / "leanact"):  # no checkout; untracked in one
        copy.mkdir(parents=True)
        (copy / "__init__.py").write_text("")
        assert suite.commit_of(copy) == "unknown"
    spec = importlib.machinery.ModuleSpec("leanact", None, origin=str(other / "leanact" / "__init__.py"))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec if name == "leanact" else None)
    assert suite.versions()["commit"] == "unknown"


def test_check_pytest_fails_on_failures_and_keeps_the_counts():
    rec = suite.Recorder(None, suite.COLUMNS["tests"])
    suite.check_pytest(rec, "..s\n2 passed, 1 skipped in 1.0s\n", 0)
    suite.check_pytest(rec, "no tests ran in 0.01s\n", 5)  # nothing collected: not a failure
    for out, code in (("F.\nFAILED t.py::a - x\n1 failed, 1 passed in 1s\n", 1), ("E\n1 error in 1s\n", 1),
                      ("interrupted\n", 2)):
        rec = suite.Recorder(None, suite.COLUMNS["tests"])
        with pytest.raises(RuntimeError, match="FAILED"):
            suite.check_pytest(rec, out, code)
        assert [r[0] for r in rec.data["rows"]] == ["passed", "failed", "error", "skipped"]


def test_the_tests_part_is_failed_when_pytest_has_failures(tmp_path, monkeypatch):
    """The H200 run reported the tests part "ok" with 9 failed tests: a failing pytest run makes the
    part "failed", with its counts and the failing tests kept."""
    f = tmp_path / "test_fake.py"
    f.write_text("def test_ok():\n    pass\n\n\ndef test_bad():\n    assert False\n")
    monkeypatch.setattr(suite, "_pytest_command", lambda: [sys.executable, "-m", "pytest", "-q", "-p",
                                                           "no:cacheprovider", str(f)])
    out = tmp_path / "tests.json"
    assert suite.worker("tests", str(out)) == 1
    res = json.loads(out.read_text())
    assert res["status"] == "failed" and ["passed", "1"] in res["rows"] and ["failed", "1"] in res["rows"]
    assert any("test_bad" in n for n in res["notes"]) and any("FAILED 1 test(s)" in n for n in res["notes"])
    md = suite.markdown({"device": "d", "date": "x"}, {"tests": res})
    assert "### CUDA tests — failed" in md and "| failed | 1 |" in md


def _oom():
    return torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1014.00 MiB.")


def test_an_oom_in_the_bert_part_is_a_row_and_the_part_goes_on(monkeypatch):
    """The H200 run's bert part died on an OutOfMemoryError outside its batch search (no rows): now
    the mode's row says OOM and the next modes run. Other errors still fail the part."""
    monkeypatch.setenv(suite.SMOKE_ENV, "1")

    def mode(gb, attn, how):
        if how == "patch":
            raise _oom()
        if how == "checkpointing":
            raise RuntimeError("CUDA error: out of memory")  # the older spelling
        return 4, 10.0, float("nan")

    monkeypatch.setattr(suite, "_bert_mode", mode)
    rec = suite.Recorder(None, suite.COLUMNS["bert"])
    suite.part_bert(rec, 60)
    rows = {r[0]: r for r in rec.data["rows"]}
    assert list(rows) == [m[0] for m in suite.BERT_MODES]
    for label in ("leanact", "HF sdpa + checkpointing"):
        assert rows[label][1] == "OOM" and len(rows[label]) == len(suite.COLUMNS["bert"])
        assert any(n.startswith(label + ": out of memory") for n in rec.data["notes"])
    assert rows["HF eager"][1:3] == ["4", "1.00x"]

    def broken(gb, attn, how):
        raise ValueError("not an OOM")

    monkeypatch.setattr(suite, "_bert_mode", broken)
    with pytest.raises(ValueError):
        suite.part_bert(suite.Recorder(None, suite.COLUMNS["bert"]), 60)


def test_an_oom_in_the_ops_part_is_a_row_not_a_failure(monkeypatch):
    monkeypatch.setenv(suite.SMOKE_ENV, "1")
    ok = lambda x: x * 2  # noqa: E731

    def oom(x):
        raise _oom()

    cases = [("A", "float32", (2, 3), ok, ok, None), ("B", "float32", (2, 3), oom, ok, None),
             ("C", "float32", (2, 3), ok, ok, None)]
    monkeypatch.setattr(suite, "op_cases", lambda device, tokens: cases)
    rec = suite.Recorder(None, suite.COLUMNS["ops"])
    suite.part_ops(rec, 60)
    rows = rec.data["rows"]
    assert [r[0] for r in rows] == ["A", "B", "C"] and rows[1][3] == "OOM" and len(rows[1]) == len(suite.COLUMNS["ops"])


def test_measure_step_lowers_the_batch_when_the_timed_steps_run_out_of_memory():
    """A batch that fit once in the search and not when repeated (fragmentation, optimizer state):
    the timed steps run at a lower batch instead of the OOM escaping (the H200 bert part's death)."""
    gb = suite._bert_module()
    calls = []

    def step(b):
        calls.append(b)
        if b > 8 or (b == 8 and calls.count(8) > 1):
            raise _oom()

    batch, speed, _ = gb.measure_step(step, limit=64, steps=2, device="cpu")
    assert calls[:8] == [1, 2, 4, 8, 16, 12, 10, 9] and batch == 7 and speed > 0
    assert gb.measure_step(lambda b: (_ for _ in ()).throw(_oom()), limit=8, steps=1, device="cpu") == (0, 0.0, 0.0)
    with pytest.raises(ValueError):
        gb.measure_step(lambda b: (_ for _ in ()).throw(ValueError("bug")), limit=8, steps=1, device="cpu")


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
    """``--smoke``: the GPU parts' code (a passing pytest run, leanact.patch, the offload plan,
    leanact.estimate, the batch search, the op timings) runs end to end on the CPU at tiny sizes;
    each part reports "ok" with rows, the estimate matches its real CPU step, and the markdown goes
    to --out only."""
    import os
    import subprocess

    out = tmp_path / "smoke.md"
    parts = ["tests", "bert", "llama", "estimate", "offload", "ops"]
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
