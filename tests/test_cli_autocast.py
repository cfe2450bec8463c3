"""`leanact profile --autocast bf16|fp16`: fp32 weights, the forwards under torch.autocast; the
weight copies autocast's matmuls keep are reported per layer (none for leanact's modes)."""
import json

import pytest

pytest.importorskip("transformers")

from leanact.cli.main import main  # noqa: E402
from leanact.cli.profile import ProfileConfig, run_profile  # noqa: E402
from test_cli import BERT, H, LAYERS, S, _json, _profile, bert_json  # noqa: E402,F401

LAYER_WEIGHTS = 4 * H * H + 2 * 4 * H * H  # Q, K, V, attention output; FFN in and out


@pytest.fixture(scope="module")
def autocast_result(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(BERT))
    return run_profile(ProfileConfig(str(path), seq=S, batch=2, dtype="fp32", repeats=0, autocast="bf16"))


def test_profile_autocast_json(bert_json, capsys):  # noqa: F811
    out = _json(capsys, _profile(bert_json, "--autocast", "fp16", "--repeats", "1"))
    assert out["config"]["autocast"] == "fp16" and out["config"]["dtype"] == "fp32"
    modes = {m["name"]: m for m in out["modes"]}
    for hf in ("HF eager", "HF sdpa"):
        assert modes[hf]["weight_copies"] == 2 * LAYER_WEIGHTS  # batch-independent, inside bytes_per_layer
    for lean in ("leanact recompute", "leanact tempo"):
        assert modes[lean]["weight_copies"] == 0
        assert modes[lean]["fixed_bytes"] < modes["HF sdpa"]["fixed_bytes"] - LAYERS * 2 * LAYER_WEIGHTS
    for m in modes.values():
        assert m["activation_bytes"] == m["fixed_bytes"] + 2 * m["per_sample_bytes"]
        assert m["fixed_bytes"] >= LAYERS * m["weight_copies"]
        assert m["step_ms"] > 0


def test_profile_autocast_table_fits_80_columns(bert_json, capsys, monkeypatch, autocast_result):  # noqa: F811
    monkeypatch.setattr("leanact.cli.profile.run_profile", lambda cfg, progress=None: autocast_result)
    assert main(_profile(bert_json, "--autocast", "bf16", "--repeats", "0", "--ops")) == 0
    text = capsys.readouterr().out
    for word in ("fp32 + bf16 autocast", "copies", "leanact recompute", "B/sbh"):
        assert word in text, word
    assert max(map(len, text.splitlines())) <= 80 and "…" not in text, text
    hf = {m.name: m for m in autocast_result.modes}["HF sdpa"]
    assert hf.weight_copies == 2 * LAYER_WEIGHTS


@pytest.mark.parametrize("bad, message", [
    (["--autocast", "fp32"], "invalid choice"),
    (["--autocast", "bf16", "--dtype", "bf16"], "drop --dtype bf16"),
])
def test_bad_autocast_arguments_exit_2(bad, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["profile", *bad])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: leanact profile") and message in err, err
