"""benchmarks/gpu_suite without a GPU: its parts' machinery (processes, limits, failures, the
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

_BENCH = pathlib.Path(__file__).parent.parent / "benchmarks"
_PKG = _BENCH / "gpu_suite"  # the package, loaded by its name without benchmarks/ on sys.path
_spec = importlib.util.spec_from_file_location("gpu_suite", _PKG / "__init__.py",
                                               submodule_search_locations=[str(_PKG)])
package = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(package)
common, cli, side_by_side = (importlib.import_module(f"gpu_suite.{m}") for m in ("common", "__main__", "side_by_side"))
bert_part, ops_part, head_part, steps_part, tests_part, liger_part = (
    importlib.import_module(f"gpu_suite.{m}") for m in ("bert", "ops", "head", "steps", "tests", "liger"))


def test_limits_fit_in_nine_minutes():
    assert set(common.LIMITS) == set(common.PARTS + common.OPTIONAL) == set(common.COLUMNS)
    assert common.TOTAL_S < 9.5 * 60


def test_parse_pytest_summary():
    out = "....F.s\nFAILED tests/x.py::t - boom\n3 passed, 1 failed, 2 skipped, 1 error in 4.5s\n"
    assert tests_part.parse_pytest(out) == {"passed": 3, "failed": 1, "skipped": 2, "error": 1}
    assert tests_part.parse_pytest("") == {}
    assert tests_part.parse_pytest("no tests ran in 0.01s") == {}


@pytest.mark.slow
@pytest.mark.parametrize("forked", [False, pytest.param(True, marks=pytest.mark.skipif(
    not hasattr(__import__("os"), "fork"), reason="no fork"))])
def test_a_part_that_works_fails_or_hangs_is_reported_and_the_next_still_runs(forked):
    """Each part in a fresh interpreter, or (a smoke run) forked from this process."""
    fork = cli.worker if forked else None
    ok = common.run_part("_selftest_ok", 60, forked=fork)
    assert ok["status"] == "ok" and ok["rows"] == [["first", "1.5"], ["second", "2"]]
    failed = common.run_part("_selftest_fail", 60, forked=fork)
    assert failed["status"] == "failed" and failed["rows"] == [["first", "1.5"]]
    assert any("RuntimeError: boom" in n for n in failed["notes"])
    hung = common.run_part("_selftest_hang", 3, forked=fork)
    assert hung["status"] == "timeout" and hung["rows"] == [["first", "1.5"]]  # what it finished is kept
    assert any("limit of 3 s" in n for n in hung["notes"])
    md = common.markdown({"device": "GPU X", "date": "2030-01-01", "torch": "9.9"},
                         {"_selftest_ok": ok, "_selftest_fail": failed, "_selftest_hang": hung})
    assert md.startswith("## GPU suite — GPU X, 2030-01-01") and "torch 9.9" in md
    assert "### _selftest_ok — ok" in md and "| first | 1.5 |" in md and "| second | 2 |" in md
    assert "### _selftest_fail — failed" in md and "### _selftest_hang — timeout" in md


def test_a_worker_that_dies_without_results():
    res = common.run_part("_no_such_part", 60)
    assert res["status"] == "failed" and res["notes"]


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="no fork")
def test_a_forked_part_that_dies_without_results_and_its_environment():
    res = common.run_part("_no_such_part", 60, forked=cli.worker)
    assert res["status"] == "failed" and any("KeyError" in n for n in res["notes"]), res["notes"]

    def part(name, path):
        rec = common.Recorder(path, ["item", "value"])
        rec.row("X_ENV", __import__("os").environ.get("X_ENV"))
        rec.done("ok")
        return 0

    seen = common.run_part("_env", 60, forked=part, extra_env={"X_ENV": "set"})
    assert seen["status"] == "ok" and seen["rows"] == [["X_ENV", "set"]], seen
    assert "X_ENV" not in __import__("os").environ  # the child's environment only


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="no fork")
def test_an_interrupted_smoke_run_leaves_no_forked_part_behind(monkeypatch):
    """Ctrl-C while a forked part runs: the part is killed and reaped, not left running."""
    import os

    pids, fork = [], os.fork

    def recording_fork():
        pid = fork()
        if pid:
            pids.append(pid)
        return pid

    def interrupt(seconds):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fork", recording_fork)
    # the parent's wait, interrupted at once (common's own view of the time module: other threads keep theirs)
    monkeypatch.setattr(common, "time", types.SimpleNamespace(monotonic=common.time.monotonic, sleep=interrupt))
    with pytest.raises(KeyboardInterrupt):
        common.run_forked(lambda: next(iter(int, 1)), 60, {})  # a part that never ends
    assert len(pids) == 1
    with pytest.raises(ChildProcessError):  # killed and reaped already
        os.waitpid(pids[0], os.WNOHANG)


def test_markdown_of_an_empty_failed_part():
    md = common.markdown({"device": "d", "date": "x"}, {"ops": {"status": "failed", "notes": ["no CUDA"]}})
    assert "### Per-op forward+backward time (ms, median) — failed" in md and "(no rows)" in md and "- no CUDA" in md


def test_ratios_against_hf_sdpa():
    rows = [("HF sdpa", 20, 100.0), ("leanact", 36, 120.0), ("HF eager", 0, 0.0)]
    r = {m: (rb, rs) for m, rb, rs in bert_part.bert_ratios(rows)}
    assert r["leanact"] == (1.8, 1.2) and r["HF sdpa"] == (1.0, 1.0) and r["HF eager"] == (0.0, 0.0)
    nan = bert_part.bert_ratios([("leanact", 3, 1.0)])[0]
    assert nan[1] != nan[1] and nan[2] != nan[2]
    cell = common._cell
    assert cell(float("nan")) == "n/a" and cell(1234.5) == "1234.5" and cell(0.0123456) == "0.0123"


def test_versions_never_raise():
    v = common.versions()
    assert v["torch"] == torch.__version__ and {"triton", "transformers", "liger-kernel", "commit"} <= set(v)


def test_liger_version_comes_from_its_distribution(monkeypatch):
    """liger_kernel has no ``__version__`` (the H200 run's header said "liger_kernel ?"): the
    distribution's version; "not installed" when neither imports nor is installed."""
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))  # no __version__
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda d: "0.8.5" if d == "liger-kernel" else real(d))
    v = common.versions()
    assert v["liger-kernel"] == "0.8.5"
    assert "liger-kernel 0.8.5" in common.markdown({"device": "d", "date": "x", **v}, {})
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # import fails

    def missing(d):
        raise importlib.metadata.PackageNotFoundError(d)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert common.versions()["liger-kernel"] == "not installed"


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
    assert _git(other, "init", "-q").returncode == 0
    assert _git(other, "commit", "-q", "--allow-empty", "-m", "x").returncode == 0
    monkeypatch.chdir(other)  # another repository as the working directory
    if _git(pkg, "ls-files", "--error-unmatch", "__init__.py").returncode == 0:
        assert common.versions()["commit"].split(" ")[0] == _git(pkg, "rev-parse", "--short", "HEAD").stdout.strip()
    repo = tmp_path / "repo"  # a checkout whose tracked files differ from its commit says so
    (repo / "leanact").mkdir(parents=True)
    (repo / "leanact" / "__init__.py").write_text("x = 1\n")
    assert _git(repo, "init", "-q").returncode == 0 and _git(repo, "add", ".").returncode == 0
    assert _git(repo, "commit", "-q", "-m", "x").returncode == 0
    head = _git(repo, "rev-parse", "--short", "HEAD").stdout.strip()
    assert common.commit_of(repo / "leanact") == head
    (repo / "leanact" / "__init__.py").write_text("x = 2\n")
    assert common.commit_of(repo / "leanact") == head + " + uncommitted changes"
    for copy in (tmp_path / "copy" / "leanact", other / "leanact"):  # no checkout; untracked in one
        copy.mkdir(parents=True)
        (copy / "__init__.py").write_text("")
        assert common.commit_of(copy) == "unknown"
    spec = importlib.machinery.ModuleSpec("leanact", None, origin=str(other / "leanact" / "__init__.py"))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec if name == "leanact" else None)
    assert common.versions()["commit"] == "unknown"


def test_check_pytest_fails_on_failures_and_keeps_the_counts():
    rec = common.Recorder(None, common.COLUMNS["tests"])
    tests_part.check_pytest(rec, "..s\n2 passed, 1 skipped in 1.0s\n", 0)
    tests_part.check_pytest(rec, "no tests ran in 0.01s\n", 5)  # nothing collected: not a failure
    for out, code in (("F.\nFAILED t.py::a - x\n1 failed, 1 passed in 1s\n", 1), ("E\n1 error in 1s\n", 1),
                      ("interrupted\n", 2)):
        rec = common.Recorder(None, common.COLUMNS["tests"])
        with pytest.raises(RuntimeError, match="FAILED"):
            tests_part.check_pytest(rec, out, code)
        assert [r[0] for r in rec.data["rows"]] == ["passed", "failed", "error", "skipped"]


def test_the_tests_part_is_failed_when_pytest_has_failures(tmp_path, monkeypatch):
    """The H200 run reported the tests part "ok" with 9 failed tests: a failing pytest run makes the
    part "failed", with its counts and the failing tests kept."""
    f = tmp_path / "test_fake.py"
    f.write_text("def test_ok():\n    pass\n\n\ndef test_bad():\n    assert False\n")
    monkeypatch.setattr(tests_part, "_pytest_command", lambda: [sys.executable, "-m", "pytest", "-q", "-p",
                                                                "no:cacheprovider", str(f)])
    out = tmp_path / "tests.json"
    assert cli.worker("tests", str(out)) == 1
    res = json.loads(out.read_text())
    assert res["status"] == "failed" and ["passed", "1"] in res["rows"] and ["failed", "1"] in res["rows"]
    assert any("test_bad" in n for n in res["notes"]) and any("FAILED 1 test(s)" in n for n in res["notes"])
    md = common.markdown({"device": "d", "date": "x"}, {"tests": res})
    assert "### CUDA tests — failed" in md and "| failed | 1 |" in md


def _oom():
    return torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1014.00 MiB.")


@pytest.mark.slow
def test_an_oom_in_the_bert_part_is_a_row_and_the_part_goes_on(monkeypatch):
    """The H200 run's bert part died on an OutOfMemoryError outside its batch search (no rows): now
    the mode's row says OOM and the next modes run. Other errors still fail the part."""
    monkeypatch.setenv(common.SMOKE_ENV, "1")

    def mode(gb, attn, how):
        if how == "patch":
            raise _oom()
        if how == "checkpointing":
            raise RuntimeError("CUDA error: out of memory")  # the older spelling
        return 4, 10.0, float("nan")

    monkeypatch.setattr(bert_part, "_bert_mode", mode)
    rec = common.Recorder(None, common.COLUMNS["bert"])
    bert_part.part_bert(rec, 60)
    rows = {(r[0], r[1]): r for r in rec.data["rows"]}
    assert list(rows) == [("8", "HF sdpa"), ("8", "leanact"), ("16", "HF sdpa"), ("16", "leanact"), ("16", "HF eager"),
                          ("16", "HF sdpa + checkpointing")]
    for key in (("8", "leanact"), ("16", "leanact"), ("16", "HF sdpa + checkpointing")):
        assert rows[key][2] == "OOM" and len(rows[key]) == len(common.COLUMNS["bert"])
        assert any(n.startswith(" ".join(key) + ": out of memory") for n in rec.data["notes"])
    assert rows[("16", "HF eager")][2:4] == ["4", "1.00x"]

    def broken(gb, attn, how):
        raise ValueError("not an OOM")

    monkeypatch.setattr(bert_part, "_bert_mode", broken)
    with pytest.raises(ValueError):
        bert_part.part_bert(common.Recorder(None, common.COLUMNS["bert"]), 60)


def test_bert_part_runs_tempos_comparison_under_each_cap_and_checks_its_targets(monkeypatch):
    """Tempo's comparison: HF sdpa and leanact at their own largest batches under 8 and 16 GiB (the
    others under 16 GiB only, last), each cap set before its modes, ratios to HF sdpa under the same
    cap, leanact's targets (8 GiB: batch ≥ 1.6x, throughput ≥ 1.16x; 16 GiB: ≥ 1.6x, ≥ 1.0x)."""
    monkeypatch.setenv(common.SMOKE_ENV, "0")
    caps, measured = [], {("sdpa", None): [(2, 10.0, 7.9), (5, 11.0, 15.9)], ("sdpa", "patch"): [(4, 12.0, 7.5),
                                                                                               (8, 10.5, 15.0)],
                          ("eager", None): [(3, 9.0, 15.0)], ("sdpa", "checkpointing"): [(9, 7.0, 14.0)]}

    class Props:
        total_memory = 64 * 2**30

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props())
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f: caps.append(f * 64))
    monkeypatch.setattr(bert_part, "_bert_mode", lambda gb, attn, how: measured[attn, how].pop(0))
    monkeypatch.setattr(bert_part, "bert_module", lambda: type("GB", (), {"_free": staticmethod(lambda: None)}))
    rec = common.Recorder(None, common.COLUMNS["bert"])
    bert_part.part_bert(rec, 60)
    rows = {(r[0], r[1]): r for r in rec.data["rows"]}
    assert caps == [8, 8, 16, 16, 16, 16]
    assert rows[("8", "leanact")][2:4] == ["4", "2.00x"] and rows[("8", "leanact")][5] == "1.20x"
    assert rows[("8", "leanact")][7] == "batch ok (≥ 1.6x), throughput ok (≥ 1.16x)"
    assert rows[("16", "leanact")][7] == "batch ok (≥ 1.6x), throughput no (≥ 1x)"  # 10.5 / 11 seq/s
    assert rows[("16", "HF eager")][3] == "0.60x" and rows[("16", "HF eager")][7] == ""
    assert len(rows) == 6 and all(len(r) == len(common.COLUMNS["bert"]) for r in rows.values())


def test_ops_part_gives_the_bytes_moved_and_the_peak_bandwidth():
    """GB/s = the bytes leanact's kernels must move (docs/triton.md) / its time; the peak from the memory
    clock and bus width where torch reports them, else the datasheet value by name."""
    n = 16384 * 4096
    assert ops_part.moved_bytes("GELU none", "bfloat16", (16384, 4096)) == (5 * 2 + 0.25) * n
    assert ops_part.moved_bytes("dropout p=0.1", "float32", (16384, 4096)) == 16 * n
    assert ops_part.moved_bytes("RMSNorm", "bfloat16", (16384, 2048)) == 10 * 16384 * 2048
    assert ops_part.moved_bytes("SwiGLU + down", "bfloat16", (4096, 16384)) is None

    class Props:
        name, memory_clock_rate, memory_bus_width = "NVIDIA H100 80GB HBM3", 2_619_000, 5120

    assert round(ops_part.peak_gbs(Props())[0]) == 3352
    Props.memory_clock_rate = None
    assert ops_part.peak_gbs(Props()) == (3350, "datasheet value for H100")
    Props.name = "NVIDIA H100 NVL"
    assert ops_part.peak_gbs(Props())[0] == 3900
    Props.name = "Some GPU"
    assert ops_part.peak_gbs(Props())[0] is None


@pytest.mark.slow
def test_an_oom_in_the_ops_part_is_a_row_not_a_failure(monkeypatch):
    monkeypatch.setenv(common.SMOKE_ENV, "1")
    ok = lambda x: x * 2  # noqa: E731

    def oom(x):
        raise _oom()

    cases = [("A", "float32", (2, 3), ok, ok, None), ("B", "float32", (2, 3), oom, ok, None),
             ("C", "float32", (2, 3), ok, ok, None)]
    monkeypatch.setattr(ops_part, "op_cases", lambda device, tokens: cases)
    rec = common.Recorder(None, common.COLUMNS["ops"])
    ops_part.part_ops(rec, 60)
    rows = rec.data["rows"]
    assert [r[0] for r in rows] == ["A", "B", "C"] and rows[1][3] == "OOM"
    assert len(rows[1]) == len(common.COLUMNS["ops"])


@pytest.mark.slow
def test_measure_step_lowers_the_batch_when_the_timed_steps_run_out_of_memory():
    """A batch that fit once in the search and not when repeated (fragmentation, optimizer state):
    the timed steps run at a lower batch instead of the OOM escaping (the H200 bert part's death)."""
    gb = bert_part.bert_module()
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
        cli.main(["--out", str(out)])
    assert "needs a CUDA GPU" in str(exc.value.code) and not out.exists()


def test_op_cases_run_forward_and_backward_on_cpu():
    """The ops part's cases (leanact op, torch op) take the same input and give the same outputs
    (elementwise ops: of the input's shape; the MLP case: the down projection's; RoPE: q's view)."""
    for name, dt, shape, lean, ref, liger in ops_part.op_cases("cpu", tokens=4):
        if dt == "float32" and name.startswith("GELU"):
            continue  # the same calls as bfloat16's; its CPU tables take seconds to build
        torch.manual_seed(0)
        x = torch.randn(shape, dtype=getattr(torch, dt))
        outs = []
        for fn in (lean, ref):
            xi = x.clone().requires_grad_()
            y = fn(xi)
            # (fp32: the sub-layer end's residual stream, RoPE's tables; RoPE's output is q's (B, H, S, D) view)
            out_dtype = torch.float32 if name.startswith(("sub-layer", "RoPE")) else x.dtype
            same_shape = y.shape == (x.transpose(1, 2).shape if name.startswith("RoPE") else x.shape)
            assert y.dtype == out_dtype and (same_shape or name.startswith("SwiGLU")), name
            y.backward(torch.ones_like(y))
            assert xi.grad.shape == x.shape
            outs.append(y.detach())
        assert outs[0].shape == outs[1].shape, name
        if not name.startswith(("dropout", "sub-layer")):  # (two draws of the mask: leanact's, torch's)
            # the same function computed in fp32 with reductions of up to shape[-1] terms (another
            # order: n·u32), then rounded to the storage dtype (one ulp each side)
            tol = 2 * torch.finfo(x.dtype).eps + shape[-1] * 2.0**-24
            torch.testing.assert_close(outs[0].float(), outs[1].float(), rtol=tol, atol=tol, msg=name)
        assert liger is None


@pytest.mark.slow
def test_smoke_run_of_every_gpu_part_on_the_cpu(tmp_path):
    """``--smoke``: the GPU parts' code (a passing pytest run, leanact.patch, the offload plan,
    leanact.estimate, the batch search, the op timings) runs end to end on the CPU at tiny sizes;
    each part reports "ok" with rows, the estimate matches its real CPU step, and the markdown goes
    to --out only."""
    import os
    import subprocess

    out = tmp_path / "smoke.md"
    parts = ["tests", "bert", "llama", "estimate", "offload", "ops", "head", "steps", "long", "profile"]
    env = dict(os.environ, PYTHONPATH=str(_BENCH.parent), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(_PKG), "--smoke", "--parts", *parts, "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    md = out.read_text()
    assert "CPU (smoke run, tiny sizes)" in md
    sections = md.split("\n### ")[1:]
    assert len(sections) == len(parts)
    for name, section in zip(parts, sections):
        assert section.startswith(common.TITLES[name] + " — ok"), section[:300]
        rows = [ln for ln in section.splitlines()
                if ln.startswith("| ") and not ln.startswith("| " + common.COLUMNS[name][0])]
        assert rows, section
    estimate = sections[parts.index("estimate")]
    assert estimate.count("| ok |") == 2, estimate  # estimate(device="cpu") within 5% of the measured step
    offload = sections[parts.index("offload")].splitlines()
    assert int(next(ln for ln in offload if ln.startswith("| leanact + offload")).split("|")[-2]) > 0
    # every mode the CPU can run has a row of numbers; the others a note saying why not
    head = sections[parts.index("head")]
    cpu_modes = ["HF ForCausalLMLoss", "leanact (grad_in_forward, as patch trains)"]
    if hasattr(torch.nn.functional, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions"):
        cpu_modes.append("torch F.linear_cross_entropy")
    else:
        assert "no torch row" in head
    assert [r[0] for r in _rows(head)] == cpu_modes and all(float(r[1]) > 0 for r in _rows(head)), head
    assert "no Liger row" in head or "| Liger" in head
    steps = sections[parts.index("steps")]
    expect = [("Llama-3.2-1B geometry", "HF sdpa"), ("Llama-3.2-1B geometry", "leanact"),
              ("BERT-Large MLM", "HF sdpa"), ("BERT-Large MLM", "leanact"),
              ("BERT-Large MLM", "leanact, cast_recipes=False, recast_weights=False")]
    assert [tuple(r[:2]) for r in _rows(steps) if r[1] != "Liger"] == expect, steps
    assert all(float(r[3]) > 0 and r[5] == "n/a" for r in _rows(steps)), steps  # CPU: times, no peaks
    assert "no Liger row" in steps or "Liger: apply_liger" in steps or "Liger: _apply" in steps
    # the patched models' steps time the norms' one sync per step (what a host-bound step waits there)
    assert "BERT-Large MLM: the norms' per-step decision ran" in steps, steps


def test_smoke_needs_an_out_file_other_than_results_md():
    for argv in (["--smoke"], ["--smoke", "--out", str(_BENCH / "RESULTS.md")]):
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == 2


def _rows(section: str) -> list[list[str]]:
    """The cells of a markdown section's table rows (header and rule left out)."""
    lines = [ln for ln in section.splitlines() if ln.startswith("| ")]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[1:]]


def test_the_docstring_lists_every_part_in_order():
    listed = __import__("re").findall(r"^\d+\. ``(\w+)``", package.__doc__, flags=__import__("re").M)
    assert listed == common.PARTS + common.OPTIONAL and set(common.TITLES) == set(common.PARTS + common.OPTIONAL)
    assert set(common.SIZES["smoke"]) == set(common.SIZES["gpu"])


def _fake_modes(calls, fail=None):
    """Modes A, B, C whose steps append their label to ``calls``; ``fail`` = {label: (call no., exception)}."""
    fail = fail or {}

    def step(label):
        def run():
            calls.append(label)
            when, exc = fail.get(label, (None, None))
            if when is not None and calls.count(label) >= when:
                raise exc
        return run

    return [side_by_side.Mode(label, step(label)) for label in "ABC"]


def test_interleave_runs_the_modes_in_turns(monkeypatch):
    monkeypatch.setenv(common.SMOKE_ENV, "1")
    calls = []
    modes = _fake_modes(calls)
    side_by_side.interleave(modes, rounds=3, warmup=1)
    assert calls == list("ABC") * 4  # one untimed round, then three timed ones, A, B, C, A, B, C, ...
    assert all(len(m.times) == 3 and m.ms > 0 and m.peak != m.peak and m.failed is None for m in modes)
    calls.clear()
    past = side_by_side.Mode("late", lambda: calls.append("late"))
    side_by_side.interleave([past], rounds=5, warmup=1, deadline=0.0)  # past the deadline: one timed round still
    assert calls == ["late", "late"] and len(past.times) == 1


@pytest.mark.slow
def test_interleave_drops_a_mode_that_fails_and_goes_on(monkeypatch):
    monkeypatch.setenv(common.SMOKE_ENV, "1")
    calls = []
    modes = _fake_modes(calls, {"B": (2, _oom()), "C": (3, ValueError("bug"))})
    side_by_side.interleave(modes, rounds=3, warmup=1)
    assert calls == list("ABC") + list("ABC") + list("AC") + list("A")
    a, b, c = modes
    assert len(a.times) == 3 and a.failed is None
    assert b.failed[0] == "OOM" and "OutOfMemoryError" in b.failed[1] and b.step is None and b.times == []
    assert c.failed[0] == "error" and "ValueError: bug" in c.failed[1] and len(c.times) == 1


@pytest.mark.slow
def test_compare_builds_each_mode_then_interleaves_and_survives_a_failed_build(monkeypatch):
    monkeypatch.setenv(common.SMOKE_ENV, "1")
    calls = []

    def builder(label):
        def build():
            calls.append("build " + label)
            if label == "B":
                raise _oom()
            return lambda: calls.append(label)
        return label, build

    rec = common.Recorder(None, common.COLUMNS["steps"])
    modes = side_by_side.compare(rec, "fake", [builder(x) for x in "ABC"], rounds=2)
    # each built mode steps once after its build, then one untimed and two timed rounds in turns
    assert calls == ["build A", "A", "build B", "build C", "C"] + list("AC") * 3
    assert [m.failed and m.failed[0] for m in modes] == [None, "OOM", None]
    assert [len(m.times) for m in modes] == [2, 0, 2]


@pytest.mark.slow
def test_modes_that_do_not_fit_together_run_one_after_another_each_freed_first(monkeypatch):
    """When the first mode's memory says the models do not all fit, each is built, timed and freed
    before the next is built: no reference to a finished mode's model is left behind."""
    import gc
    import weakref

    monkeypatch.setenv(common.SMOKE_ENV, "1")
    monkeypatch.setattr(side_by_side, "_total_memory", lambda: 1.0)  # (NaN peaks on the CPU never fit)
    calls, models = [], []

    class Model:  # (weakly referenced: a SimpleNamespace cannot be)
        pass

    def builder(label):
        def build():
            gc.collect()
            calls.append(("build " + label, [r() is not None for r in models]))
            model = Model()
            model.name = label
            models.append(weakref.ref(model))
            return lambda: calls.append(model.name)
        return label, build

    rec = common.Recorder(None, common.COLUMNS["steps"])
    modes = side_by_side.compare(rec, "fake", [builder(x) for x in "ABC"], rounds=2)
    # A: a step after its build, one more to measure its peak; then each mode alone: 1 untimed + 2 timed
    assert calls == [("build A", []), "A", "A", "A", "A", "A", ("build B", [False]), "B", "B", "B", "B",
                     ("build C", [False, False]), "C", "C", "C", "C"]
    assert [len(m.times) for m in modes] == [2, 2, 2] and all(m.step is None for m in modes)
    assert any("each built, timed and freed in turn" in n for n in rec.data["notes"])


def test_modes_stay_allocated_together_only_when_they_fit():
    gib = 2**30
    # Llama-1B fp32 + AdamW: ~13.8 GiB kept per model, HF's step peaks at ~43.8 GiB
    assert side_by_side.fits_together(3, 13.8 * gib, 43.8 * gib, 139.8 * gib)  # H200
    assert not side_by_side.fits_together(3, 13.8 * gib, 43.8 * gib, 79.2 * gib)  # H100: one after another
    assert side_by_side.fits_together(1, 70 * gib, 79 * gib, 100 * gib)
    assert not side_by_side.fits_together(1, 0, 91 * gib, 100 * gib)


def _head_case(monkeypatch, modes):
    monkeypatch.setenv(common.SMOKE_ENV, "1")
    monkeypatch.setattr(head_part, "head_modes", lambda rec: modes)
    return common.Recorder(None, common.COLUMNS["head"])


@pytest.mark.slow
def test_an_oom_in_the_head_part_is_a_row_and_the_other_modes_keep_theirs(monkeypatch):
    hm = common.bench_module("head")

    def oom(x, w, labels):
        raise _oom()

    def liger_bug(x, w, labels):
        raise ValueError("not ours")

    rec = _head_case(monkeypatch, [("HF ForCausalLMLoss", hm.hf_loss), ("leanact", hm.lean_loss(True)),
                                   ("torch F.linear_cross_entropy", oom), ("Liger X", liger_bug)])
    head_part.part_head(rec, 60)  # Liger's (or torch's) errors are rows, not the part's failure
    rows = {r[0]: r for r in rec.data["rows"]}
    assert list(rows) == ["HF ForCausalLMLoss", "leanact", "torch F.linear_cross_entropy", "Liger X"]
    assert rows["torch F.linear_cross_entropy"][1] == "OOM" and rows["Liger X"][1] == "error"
    assert all(len(r) == len(common.COLUMNS["head"]) for r in rows.values())
    assert rows["HF ForCausalLMLoss"][2] == "1.000x" and float(rows["leanact"][1]) > 0
    assert float(rows["leanact"][6]) < 1e-2 and rows["leanact"][7] == "2"  # matches HF; two timed runs
    assert any(n.startswith("torch F.linear_cross_entropy: out of memory") for n in rec.data["notes"])

    rec = _head_case(monkeypatch, [("HF ForCausalLMLoss", hm.hf_loss), ("leanact", liger_bug)])
    with pytest.raises(RuntimeError, match="leanact"):  # leanact's own error fails the part, rows kept
        head_part.part_head(rec, 60)
    assert [r[1] for r in rec.data["rows"]][1] == "error"


def test_liger_head_row_takes_the_weight_first_and_shifted_labels(monkeypatch):
    """Liger's loss is called as (W, x (N, h), labels shifted as HF shifts them): a fake Liger that
    computes the plain cross-entropy from those matches HF's loss and gradients."""
    import torch.nn.functional as F

    class FakeLoss:
        def __call__(self, w, x, target):
            return F.cross_entropy(F.linear(x, w).float(), target, ignore_index=-100)

    fake = types.ModuleType("liger_kernel.transformers")
    fake.LigerFusedLinearCrossEntropyLoss = FakeLoss
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", fake)
    monkeypatch.setenv(common.SMOKE_ENV, "1")
    rec = common.Recorder(None, common.COLUMNS["head"])
    head_part.part_head(rec, 60)
    liger = next(r for r in rec.data["rows"] if r[0].startswith("Liger"))
    assert float(liger[1]) > 0 and float(liger[6]) < 1e-2, liger
    assert any("time vs Liger" in n for n in rec.data["notes"])


@pytest.mark.slow
def test_an_oom_in_the_steps_part_is_a_row_and_the_other_modes_keep_theirs(monkeypatch):
    monkeypatch.setenv(common.SMOKE_ENV, "1")

    def ok():
        return lambda: None

    def oom():
        raise _oom()

    monkeypatch.setattr(steps_part, "llama_builders",
                        lambda rec, b, s: [("HF sdpa", ok), ("Liger", oom), ("leanact", ok)])
    monkeypatch.setattr(steps_part, "bert_builders", lambda rec, b, s: [("HF sdpa", oom), ("leanact", ok)])
    rec = common.Recorder(None, common.COLUMNS["steps"])
    steps_part.part_steps(rec, 60)
    rows = [r[:4] for r in rec.data["rows"]]
    llama, bert = "Llama-3.2-1B geometry", "BERT-Large MLM"
    assert [r[:3] for r in rows] == [[llama, "HF sdpa", "1x16"], [llama, "Liger", "OOM"], [llama, "leanact", "1x16"],
                                     [bert, "HF sdpa", "OOM"], [bert, "leanact", "2x16"]]
    assert all(len(r) == len(common.COLUMNS["steps"]) for r in rec.data["rows"])
    assert rec.data["rows"][4][4] == "n/a"  # no ratio without HF's row
    assert any(n.startswith(f"{llama} Liger: out of memory") for n in rec.data["notes"])

    def bug():
        raise ValueError("bug")

    monkeypatch.setattr(steps_part, "bert_builders", lambda rec, b, s: [("HF sdpa", ok), ("leanact", bug)])
    with pytest.raises(RuntimeError, match="BERT-Large MLM leanact"):
        steps_part.part_steps(common.Recorder(None, common.COLUMNS["steps"]), 60)


def test_attribute_swap_keeps_a_global_patch_to_its_own_mode():
    mod = types.ModuleType("fake_modeling")

    def rope(x):
        return x

    class Model:
        __module__ = "fake_modeling"

        def forward(self):
            return "hf"

    mod.rope, mod.Model = rope, Model

    def patch():
        mod.rope = lambda x: -x
        mod.Model.forward = lambda self: "liger"
        mod.Extra = 1

    swap = liger_part.AttributeSwap(mod)
    swap.capture(patch)
    assert mod.rope is rope and Model().forward() == "hf" and not hasattr(mod, "Extra")
    with swap.active():
        assert mod.rope(2) == -2 and Model().forward() == "liger" and mod.Extra == 1
    assert mod.rope is rope and Model().forward() == "hf" and not hasattr(mod, "Extra")
    assert set(swap.describe().split(", ")) == {"fake_modeling.rope", "fake_modeling.Extra", "Model.forward"}


def _fake_liger(monkeypatch, apply):
    fake = types.ModuleType("liger_kernel.transformers")
    fake.apply_liger_kernel_to_llama = apply
    top = types.ModuleType("liger_kernel")
    top.transformers = fake
    monkeypatch.setitem(sys.modules, "liger_kernel", top)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", fake)


def test_liger_llama_patch_passes_only_the_options_its_version_takes(monkeypatch):
    seen = {}

    def apply(rope=True, rms_norm=True, swiglu=True, model=None):
        seen.update(rope=rope, rms_norm=rms_norm, swiglu=swiglu)

    _fake_liger(monkeypatch, apply)
    (how, fn), what = liger_part.liger_llama_patch()
    fn()
    assert how == "before" and seen == dict(rope=True, rms_norm=True, swiglu=True)
    assert "takes no fused_linear_cross_entropy" in what
    monkeypatch.setitem(sys.modules, "liger_kernel", None)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", None)
    patch, why = liger_part.liger_llama_patch()
    assert patch is None and "does not import" in why


@pytest.mark.slow
def test_the_liger_llama_patch_reaches_its_model_only(monkeypatch):
    """A stand-in for Liger's apply_liger_kernel_to_llama that rebinds modeling_llama's RMSNorm class
    and RoPE function process-wide: the Liger model is built with the one and steps with the other,
    the HF and leanact models stepping in turns with it use neither, and modeling_llama is as it
    was afterwards (but for leanact's rotation, which routes to HF's function)."""
    from transformers.models.llama import modeling_llama

    original_norm, original_rope = modeling_llama.LlamaRMSNorm, modeling_llama.apply_rotary_pos_emb
    calls = []

    class LigerRMSNorm(original_norm):
        pass

    def liger_rope(*args, **kwargs):
        calls.append(1)
        return original_rope(*args, **kwargs)

    def apply(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True):
        modeling_llama.LlamaRMSNorm = LigerRMSNorm
        modeling_llama.apply_rotary_pos_emb = liger_rope

    _fake_liger(monkeypatch, apply)
    monkeypatch.setenv(common.SMOKE_ENV, "1")
    monkeypatch.setattr(steps_part, "bert_builders", lambda rec, b, s: [("HF sdpa", lambda: lambda: None),
                                                                        ("leanact", lambda: lambda: None)])
    rec = common.Recorder(None, common.COLUMNS["steps"])
    steps_part.part_steps(rec, 60)
    def hf(rope):  # HF's function, or leanact's replacement routing to it
        return getattr(rope, "_leanact_original", rope)

    assert modeling_llama.LlamaRMSNorm is original_norm and hf(modeling_llama.apply_rotary_pos_emb) is hf(original_rope)
    rows = {r[1]: r for r in rec.data["rows"] if r[0].startswith("Llama")}
    assert list(rows) == ["HF sdpa", "Liger", "leanact"] and float(rows["Liger"][3]) > 0
    layers = common.SIZES["smoke"]["llama"]["num_hidden_layers"]
    liger_steps = 1 + 1 + int(rows["Liger"][7])  # after its build, the untimed round, the timed ones
    assert len(calls) == liger_steps * layers  # Liger's RoPE ran in Liger's forwards only
    note = next(n for n in rec.data["notes"] if n.startswith("Liger: apply_liger_kernel_to_llama("))
    assert "modeling_llama.LlamaRMSNorm" in note and "modeling_llama.apply_rotary_pos_emb" in note
    assert f"{2 * layers + 1} LigerRMSNorm" in note  # two per layer and the final norm



@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "drift"])
def test_norm_sync_ab_runs_the_steps_part_with_and_without_the_per_step_check(mode):
    """benchmarks/norm_sync_ab.py (smoke sizes, CPU): ``sync`` checks every verdict after each step
    (as many batched checks as decisions), ``drift`` lets them stand under AdamW's bound (fewer)."""
    import os
    import re
    import subprocess

    script = _BENCH / "norm_sync_ab.py"
    env = dict(os.environ, LEANACT_GPU_SUITE_SMOKE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(script), mode], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith(mode + " "))
    note = re.search(r"BERT-Large MLM: the norms' per-step decision ran (\d+) times \(median [0-9.]+ ms\), (\d+) of",
                     line)
    assert note, line
    ran, checked = int(note.group(1)), int(note.group(2))
    assert ran >= 2 and (checked == ran if mode == "sync" else checked < ran), line


def test_op_host_smoke_reports_every_op(tmp_path, capsys):
    """benchmarks/op_host.py --smoke (CPU, kernels stubbed): a row of positive times per op, the
    launch line and the profile; --out gets the same report."""
    spec = importlib.util.spec_from_file_location("op_host", _BENCH / "op_host.py")
    op_host = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(op_host)
    out = tmp_path / "op_host.md"
    assert op_host.main(["--smoke", "--out", str(out)]) == 0
    report = out.read_text()
    assert report.strip() == capsys.readouterr().out.strip()
    rows = [ln for ln in report.splitlines() if ln.startswith("| ") and not ln.startswith("| op ")]
    assert [r.split(" | ")[0][2:] for r in rows] == ["GELU", "LayerNorm", "sub-layer end (dropout, add, LayerNorm)"]
    assert all(float(c) > 0 for r in rows for c in r.strip(" |").split(" | ")[1:]), rows
    assert "- n/a (no CUDA)" in report and "cProfile of 5 leanact GELU" in report


@pytest.mark.slow
def test_smoke_run_of_the_compiled_part(tmp_path):
    """``--parts compiled`` (only when named): the steps part's models under torch.compile (backend eager in
    a smoke run), a row per mode and each model's first step noted."""
    import os
    import subprocess

    out = tmp_path / "smoke.md"
    env = dict(os.environ, PYTHONPATH=str(_BENCH.parent), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(_PKG), "--smoke", "--parts", "compiled", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    section = out.read_text().split("\n### ")[1]
    assert section.startswith(common.TITLES["compiled"] + " — ok"), section[:300]
    rows = [r for r in _rows(section)]
    assert [(r[0], r[1]) for r in rows if r[1] != "Liger"] == [
        ("Llama-3.2-1B geometry (compiled)", "HF sdpa"), ("Llama-3.2-1B geometry (compiled)", "leanact"),
        ("BERT-Large MLM (compiled)", "HF sdpa"), ("BERT-Large MLM (compiled)", "leanact")], section
    assert section.count("first step (tracing and compiling included)") == len(rows), section
