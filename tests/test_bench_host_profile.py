"""benchmarks/host_profile.py runs (on the CPU: tiny sizes) and prints both step times and the profile."""
import importlib.util
import pathlib

import pytest

pytest.importorskip("transformers")

HERE = pathlib.Path(__file__).resolve().parent


@pytest.mark.slow
@pytest.mark.parametrize("model", ["bert-large", "llama-1b"])
def test_host_profile_prints_times_and_leanact_functions(model, capsys):
    spec = importlib.util.spec_from_file_location("host_profile", HERE.parent / "benchmarks" / "host_profile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--model", model, "--steps", "1", "--top", "5"]) == 0
    out = capsys.readouterr().out
    assert f"{model} on cpu: HF " in out and ", leanact " in out
    assert "by tottime" in out and "by cumulative (leanact functions)" in out
    assert "/leanact/" in out.split("by cumulative (leanact functions)")[1]


@pytest.mark.slow
def test_host_stub_prints_each_variant(capsys, monkeypatch):
    """benchmarks/host_stub.py: the CUDA path with the kernels stubbed, HF and leanact's variants, one row each."""
    monkeypatch.syspath_prepend(str(HERE.parent / "benchmarks"))
    spec = importlib.util.spec_from_file_location("host_stub", HERE.parent / "benchmarks" / "host_stub.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    threads = __import__("torch").get_num_threads()
    try:
        assert mod.main(["--steps", "1"]) == 0
    finally:
        __import__("torch").set_num_threads(threads)
    out = capsys.readouterr().out
    assert "kernels stubbed" in out
    for name in mod.VARIANTS:
        assert f"| {name} | " in out
