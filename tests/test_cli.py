import json
import subprocess
import sys

import pytest

from leanact.cli.main import main

SMALL = ["profile", "--hidden", "64", "--heads", "4", "--seq", "32", "--batch", "2", "--repeats", "1"]


def test_profile_json_small(capsys):
    assert main(SMALL + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    plain, lean = out["modes"]
    assert plain["name"] == "torch.nn" and lean["name"] == "leanact"
    # bf16 HF-eager-style layer on the CPU: 36 + 6as/h B/sbh plus LayerNorm statistics (see test_meter).
    assert plain["per_sbh"] == 36 + 6 * 4 * 32 / 64 + 8 / 64  # + 2 LayerNorms x (mean, rstd) in bf16
    assert lean["bytes_per_layer"] < plain["bytes_per_layer"]
    assert lean["by_op"].get("Gelu", 0) == 0 and lean["by_op"].get("NativeLayerNorm", 0) == 0


def test_profile_table_small(capsys):
    assert main(SMALL) == 0
    text = capsys.readouterr().out
    assert "total per layer" in text and "leanact" in text and "B/sbh" in text


@pytest.mark.parametrize("bad", [["--hidden", "65"], ["--seq", "0"], ["--dropout", "1.5"], ["--dtype", "int8"],
                                 ["--batch", "two"]])
def test_bad_arguments_exit_2_with_a_message(bad, capsys):
    with pytest.raises(SystemExit) as exc:
        main(SMALL + bad)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_console_script_entry_point():
    out = subprocess.run([sys.executable, "-m", "leanact.cli.main", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "profile" in out.stdout
