"""benchmarks/gpu_bert_large.py: the batch search, the ratios and the report (CPU), the run (CUDA)."""
import importlib.util
import io
import pathlib
import sys

import pytest
import torch

_PATH = pathlib.Path(__file__).parent.parent / "benchmarks" / "gpu_bert_large.py"
_spec = importlib.util.spec_from_file_location("gpu_bert_large", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench  # dataclasses look their module up there
_spec.loader.exec_module(bench)


@pytest.mark.parametrize("largest", [0, 1, 2, 3, 7, 8, 9, 100, 1000])
@pytest.mark.parametrize("limit", [1, 64, 1024])
def test_largest_fitting_finds_the_boundary(largest, limit):
    calls = []

    def fits(b):
        assert 1 <= b <= limit, b  # never tries a batch beyond the limit
        calls.append(b)
        return b <= largest

    assert bench.largest_fitting(fits, limit) == min(largest, limit)
    assert len(calls) <= 2 * max(limit, 2).bit_length() + 1  # doubling then bisection


def test_ratios_and_markdown():
    rows = [bench.Row("bf16", "HF eager", 4, 10.0, 15.0), bench.Row("bf16", "leanact recompute", 13, 12.5, 15.5),
            bench.Row("fp16", "HF eager", 5, 20.0, 15.0), bench.Row("fp16", "leanact recompute", 10, 22.0, 15.1)]
    r = {(row.precision, row.mode): (rb, rs) for row, rb, rs in bench.ratios(rows)}
    assert r[("bf16", "leanact recompute")] == (13 / 4, 1.25)
    assert r[("fp16", "leanact recompute")] == (2.0, 22.0 / 20.0)
    md = bench.markdown(rows, "NVIDIA H100", 16, 512, "autocast", "2026-11-21")
    assert "NVIDIA H100" in md and "| bf16 | leanact recompute | 13 | 3.25x | 12.5 | 1.25x | 15.50 |" in md
    assert "batch ok" in _text(bench.table(rows, "t")) and "speed < 1.2x" in _text(bench.table(rows, "t"))


def _text(table):
    from rich.console import Console

    console = Console(record=True, width=200, file=io.StringIO())
    console.print(table)
    return console.export_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_exits_with_a_clear_message_without_cuda():
    with pytest.raises(SystemExit) as exc:
        bench.main([])
    assert "needs a CUDA GPU" in str(exc.value.code)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_one_mode_runs_on_cuda():
    pytest.importorskip("transformers")
    row = bench.measure("HF sdpa", "sdpa", None, "bf16", "autocast", 128, steps=2, limit=2)
    assert row.batch == 2 and row.seq_per_s > 0 and row.peak_gib > 0
