"""`leanact profile` (Hugging Face models, tiny configs written to tmp_path) and `leanact layers`."""
import json
import re
import shutil
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

import leanact  # noqa: E402
from leanact.cli.main import main  # noqa: E402
from leanact.cli.profile import MODES, ProfileConfig, _cost, max_batch, mode_model, run_profile  # noqa: E402
from leanact.cli.sizes import format_bytes, parse_size  # noqa: E402
from leanact.models.geometries import GEOMETRIES, resolve  # noqa: E402

H, A, S, LAYERS = 64, 4, 32, 3
BERT = dict(model_type="bert", architectures=["BertForMaskedLM"], hidden_size=H, num_hidden_layers=LAYERS,
            num_attention_heads=A, intermediate_size=4 * H, vocab_size=100, max_position_embeddings=64)


@pytest.fixture
def bert_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(BERT))
    return str(path)


@pytest.fixture(scope="module")
def tiny_result(tmp_path_factory):
    """run_profile of the tiny BERT at b=2, memory only (shared by the tests that only read it)."""
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(BERT))
    return run_profile(ProfileConfig(str(path), seq=S, batch=2, repeats=0))


def _json(capsys, argv):
    assert main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _profile(bert_json, *extra):
    """bf16 (the numbers below are bf16's) unless ``extra`` picks a dtype: the default depends on the CPU."""
    dtype = [] if "--dtype" in extra or "--autocast" in extra else ["--dtype", "bf16"]
    return ["profile", "--model", bert_json, "--seq", str(S), "--batch", "2", *dtype, *extra]


def test_profile_json_tiny_bert(bert_json, capsys):
    out = _json(capsys, _profile(bert_json, "--repeats", "1"))
    modes = {m["name"]: m for m in out["modes"]}
    assert list(modes) == [label for label, _, _ in MODES]
    assert out["geometry"]["layers"] == LAYERS and out["geometry"]["hidden"] == H
    eager = modes["HF eager"]
    # HF eager BERT layer, bf16, dropout 0.1: 36 + 6as/h B/sbh, plus 2 LayerNorms' statistics (8 B per token).
    assert eager["bytes_per_layer"] == S * H * 36 + 6 * A * S * S + 8 * S
    assert eager["per_sbh"] == 36 + 6 * A * S / H + 8 / H
    for lean in ("leanact recompute", "leanact tempo"):
        assert modes[lean]["bytes_per_layer"] < eager["bytes_per_layer"]
        assert modes[lean]["by_op"].get("Gelu", 0) == 0 and modes[lean]["by_op"].get("NativeLayerNorm", 0) == 0
    assert sum(eager["by_op"].values()) == eager["bytes_per_layer"]
    # Batch-independent: BERT's token-type ids (int64, broadcast over the batch) and the loss's total weight.
    assert eager["fixed_bytes"] == 8 * S + 2
    for m in modes.values():
        assert m["activation_bytes"] == m["fixed_bytes"] + 2 * m["per_sample_bytes"]
        assert m["fixed_bytes"] + m["per_sample_bytes"] == LAYERS * m["bytes_per_layer"] + m["non_layer_bytes"]
        assert m["non_layer_bytes"] > 0 and m["step_ms"] > 0
    assert eager["step_ratio"] == 1.0
    assert out["plan"] is None and out["config"]["budget"] is None


@pytest.mark.parametrize("dtype", ["bf16", pytest.param("fp32", marks=pytest.mark.slow)])
def test_activation_memory_is_affine_in_batch(bert_json, dtype):
    """L · per layer + non-layer part, from 1- and 2-layer models at b=1 and b=2, equals what the
    full L-layer model keeps, measured directly at b=3 and b=5."""
    result = run_profile(ProfileConfig(bert_json, seq=S, batch=1, dtype=dtype, repeats=0))
    geo = resolve(bert_json)
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    full = geo.build(LAYERS, "eager", dt, seq=S)
    for (label, attn, lean), m in zip(MODES, result.modes):
        model = mode_model(full, attn, lean)
        for b in (3, 5):
            direct, _, _ = _cost(model, geo.batch_inputs(b, S, dt))
            assert direct == m.activation_at(b), (label, b)


def _no_longest(monkeypatch):
    """--budget's longest-sequence search (its own test below) left out where a test checks the rest."""
    monkeypatch.setattr("leanact.cli.profile.longest_sequence", lambda cfg: None)


def _no_step_search(monkeypatch):
    """--budget's whole-step batch search (test_budget_gives_the_largest_batch_that_fits checks it) left
    out where a test checks something else: a sentinel the output must carry through."""
    monkeypatch.setattr("leanact.cli.profile.step_max_batch", lambda geo, cfg, attn, lean: 7)


@pytest.mark.slow
def test_budget_gives_the_largest_batch_that_fits(bert_json, capsys, monkeypatch):
    from leanact.cli.profile import step_max_batch

    _no_longest(monkeypatch)
    geo = resolve(bert_json)
    tight = ProfileConfig(bert_json, seq=S, batch=2, dtype="bf16", budget=3 * 2**19).resolved(geo)  # 1.5 MiB
    for _, attn, lean in MODES:  # weights, grads and AdamW state alone exceed it
        assert step_max_batch(geo, tight, attn, lean) == 0
    # 88 MiB: on CUDA the whole step also holds two 32 MiB cuBLAS workspaces (leanact.estimate.cuda_runtime)
    out = _json(capsys, _profile(bert_json, "--repeats", "0", "--budget", "88MiB"))
    budget = out["config"]["budget"]
    for m in out["modes"]:
        b = m["max_batch"]

        def mem(n):
            return m["fixed_bytes"] + n * m["per_sample_bytes"]

        assert b >= 1 and mem(b) <= budget < mem(b + 1), m["name"]
    best = {m["name"]: m["max_batch"] for m in out["modes"]}
    # the whole step (weights, grads, AdamW state too) on CUDA: leanact.estimate at the batch and the next
    step = {m["name"]: m["step_max_batch"] for m in out["modes"]}
    for name, attn, lean in MODES:
        with torch.device("meta"):
            model = mode_model(geo.build(geo.layers, "eager", torch.bfloat16, None, S), attn, lean)
        x = geo.batch_inputs(1, S, torch.bfloat16)
        fits = [leanact.estimate(model, x, device="cuda", batch=n).peak <= budget for n in (step[name], step[name] + 1)]
        assert step[name] >= 1 and fits == [True, False], (name, step[name])
    assert best["leanact recompute"] > best["HF eager"] > best["HF sdpa"]
    assert isinstance(out["plan"], str) and out["plan"]  # the plan, or why there is none


@pytest.mark.slow
def test_budget_without_the_planner_says_so(bert_json, capsys, monkeypatch):
    _no_longest(monkeypatch)
    _no_step_search(monkeypatch)
    monkeypatch.setitem(sys.modules, "leanact.planner", None)  # import leanact.planner -> ImportError
    out = _json(capsys, _profile(bert_json, "--repeats", "0", "--budget", "1GiB"))
    assert "leanact.planner is not available" in out["plan"]
    assert all(m["max_batch"] > 0 and m["step_max_batch"] == 7 for m in out["modes"])


def _gpt2_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(model_type="gpt2", n_embd=H, n_layer=2, n_head=A, vocab_size=100, n_positions=64)))
    return str(path)


@pytest.mark.slow
def test_budget_plans_a_causal_lm_with_its_default_config(tmp_path, capsys, monkeypatch):
    """GPT-2's config has use_cache=True: the planner used to fail on it ("planner failed", exit 0)."""
    _no_longest(monkeypatch)
    _no_step_search(monkeypatch)
    out = _json(capsys, ["profile", "--model", _gpt2_json(tmp_path), "--seq", "32", "--repeats", "0",
                         "--budget", "1GiB"])
    assert "transformer.h.0" in out["plan"] and "transformer.h.1" in out["plan"], out["plan"]


@pytest.mark.parametrize("json_output", [True, False])
def test_planner_failure_exits_1_with_the_error(bert_json, capsys, json_output, monkeypatch, tiny_result):
    monkeypatch.setattr("leanact.cli.profile.run_profile", lambda cfg, progress=None: tiny_result)  # the planner fails
    argv = _profile(bert_json, "--repeats", "0", "--budget", "1KiB") + (["--json"] if json_output else [])
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "error: planner failed: InfeasibleBudget" in err and "smallest feasible budget is" in err


def test_max_batch_arithmetic():
    assert max_batch(100, 0, 10) == 10 and max_batch(109, 0, 10) == 10 and max_batch(9, 0, 10) == 0
    assert max_batch(100, 5, 10) == 9 and max_batch(3, 5, 10) == 0
    with pytest.raises(ValueError):
        max_batch(100, 0, 0)


@pytest.mark.slow
def test_tables_fit_80_columns_and_plot(bert_json, tmp_path, capsys, monkeypatch, tiny_result):
    """Piped to a file (no terminal: rich's 80 columns), every table -- modes, --ops, the plan under
    --budget -- fits without cutting a cell ("…")."""
    monkeypatch.setattr("leanact.cli.profile.run_profile", lambda cfg, progress=None: tiny_result)  # same config
    png = tmp_path / "ops.png"
    assert main(_profile(bert_json, "--repeats", "0", "--ops", "--budget", "1GiB", "--plot", str(png))) == 0
    text = capsys.readouterr().out
    for word in ("HF eager", "HF sdpa", "leanact recompute", "leanact tempo", "B/sbh", "by autograd op",
                 "bert.encoder.layer.2", "outside the layers", "max", "KiB"):
        assert word in text, word
    lines = text.splitlines()
    assert max(map(len, lines)) <= 80 and "…" not in text, text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_roles_of_kept_tensors():
    from leanact.cli.roles import COLOURS, ROLES, role_of

    assert set(COLOURS) == set(ROLES)
    cases = {("bert.encoder.layer.0.attention.self", "Bmm"): "attention",
             ("bert.encoder.layer.0.attention.self", "Mul"): "attention",  # eager's probability dropout
             ("bert.encoder.layer.0.attention.self", "RecomputeAttention"): "attention",
             ("m.layers.0.self_attn", "ScaledDotProductFlashAttentionForCpu"): "attention",
             ("bert.encoder.layer.0.attention.self.query", "Addmm"): "linear inputs",
             ("bert.encoder.layer.0.intermediate.intermediate_act_fn", "Gelu"): "GELU / activation",
             ("x", "GeluFunction"): "GELU / activation",
             ("model.layers.0.mlp", "Mul"): "GELU / activation",  # SwiGLU's product
             ("bert.encoder.layer.0.output.LayerNorm", "NativeLayerNorm"): "norms",
             ("model.layers.0.input_layernorm", "Mul"): "norms",
             ("model.layers.0.input_layernorm", "Pow"): "norms",
             ("x", "LayerNormFromOutput"): "norms",
             ("bert.encoder.layer.0.output.dropout", "Mul"): "dropout",
             ("x", "_SeededDropout"): "dropout",
             ("bert.embeddings", "Embedding"): "other"}
    for (module, op), role in cases.items():
        assert role_of(module, op) == role, (module, op)


def test_roles_add_up_to_the_layer(tiny_result):
    result = tiny_result
    for m in result.modes:
        assert sum(m.by_role.values()) == m.bytes_per_layer == sum(m.by_op.values()), m.name
        assert m.by_role.get("other", 0) == 0, (m.name, m.by_role)  # every byte of a BERT layer has a role
        # per sample, but for leanact's dropout seeds (8 bytes each, whatever the batch)
        assert 0 <= 2 * m.bytes_per_layer - m.layer_bytes <= 64, m.name
    assert result.geometry["dropout"] == [0.1]


def test_plot_without_matplotlib_names_the_extra(bert_json, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(SystemExit) as exc:
        main(_profile(bert_json, "--repeats", "0", "--plot", str(tmp_path / "a.png")))
    err = capsys.readouterr().err
    assert exc.value.code == 2 and 'pip install "leanact[plot]"' in err and "usage: leanact profile" in err


@pytest.mark.parametrize("where", ["no-such-folder/a.png", "folder.png"])
def test_unwritable_plot_path_exits_2_before_profiling(bert_json, tmp_path, capsys, where):
    (tmp_path / "folder.png").mkdir()
    with pytest.raises(SystemExit) as exc:
        main(_profile(bert_json, "--repeats", "0", "--plot", str(tmp_path / where)))
    assert exc.value.code == 2 and "cannot write --plot" in capsys.readouterr().err


def test_plot_write_error_exits_2(bert_json, tmp_path, capsys, monkeypatch, tiny_result):
    import leanact.cli.plot as plot_module

    def refuse(result, path):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(plot_module, "plot", refuse)
    monkeypatch.setattr("leanact.cli.profile.run_profile", lambda cfg, progress=None: tiny_result)
    assert main(_profile(bert_json, "--repeats", "0", "--json", "--plot", str(tmp_path / "a.png"))) == 2
    assert "cannot write --plot" in capsys.readouterr().err


def test_version(capsys):
    import leanact

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"leanact {leanact.__version__}"


def test_busy_machine_warns_about_timings(monkeypatch):
    from leanact.cli.output import busy_warning

    assert busy_warning(load=1.5, cores=2) is None
    warning = busy_warning(load=5.0, cores=2)
    assert "5.0 > 2 cores" in warning and "OMP_NUM_THREADS=1" in warning and "memory columns are exact" in warning
    monkeypatch.setattr("os.getloadavg", lambda: (1000.0, 0.0, 0.0))
    assert "OMP_NUM_THREADS=1" in busy_warning()


def test_transformers_warnings_are_quiet_in_the_cli(capfd):
    import logging as pylogging

    from transformers.utils import logging

    from leanact.cli.output import quiet_transformers

    before = logging.get_verbosity()
    with quiet_transformers():
        assert logging.get_verbosity() == pylogging.ERROR
        logging.get_logger("transformers.modeling_utils").warning("loss_type=None irrelevant here")
    assert logging.get_verbosity() == before
    assert "irrelevant here" not in capfd.readouterr().err


@pytest.mark.parametrize("family", ["gpt2", "vit"])
def test_other_families(tmp_path, capsys, family):
    if family == "gpt2":
        cfg = dict(model_type="gpt2", n_embd=H, n_layer=2, n_head=A, vocab_size=100, n_positions=64)
        seq = "32"
    else:
        cfg = dict(model_type="vit", hidden_size=H, num_hidden_layers=2, num_attention_heads=A,
                   intermediate_size=2 * H, image_size=32, patch_size=8, num_labels=5)
        seq = "17"  # 4x4 patches + [CLS]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    out = _json(capsys, ["profile", "--model", str(tmp_path), "--seq", seq, "--repeats", "0"])
    modes = {m["name"]: m for m in out["modes"]}
    assert modes["leanact recompute"]["bytes_per_layer"] < modes["HF eager"]["bytes_per_layer"]
    assert out["geometry"]["model_class"] == ("GPT2LMHeadModel" if family == "gpt2" else "ViTForImageClassification")


def test_builtin_geometries():
    g = GEOMETRIES["bert-large"]
    assert (g.hidden, g.layers, g.heads, g.vocab, g.max_seq(), g.seq) == (1024, 24, 16, 30522, 512, 512)
    llama = GEOMETRIES["llama-1b-like"].base
    assert (llama.hidden_size, llama.num_hidden_layers, llama.num_attention_heads, llama.num_key_value_heads,
            llama.intermediate_size, llama.vocab_size) == (2048, 16, 32, 8, 8192, 128256)
    assert GEOMETRIES["roberta-base"].max_seq() == 512 and GEOMETRIES["gpt2"].max_seq() == 1024
    assert GEOMETRIES["vit-base"].image_size_for(197) == 224
    for geo in GEOMETRIES.values():
        cfg = geo.make_config(layers=1, attn="sdpa", dropout=0.0, seq=geo.seq)
        assert cfg.num_hidden_layers == 1 and cfg._attn_implementation == "sdpa"
        geo.check_seq(geo.seq)


def test_parse_size():
    assert parse_size("16GiB") == 16 * 2**30 and parse_size("512MiB") == 512 * 2**20
    assert parse_size("1e9") == 10**9 and parse_size("10GB") == 10 * 10**9 and parse_size("1.5kib") == 1536
    assert parse_size("100") == 100 and parse_size("3 B") == 3
    for bad in ("16 GiBs", "abc", "", "-1GB", "0.1", "0.5", "inf", "nan", "1e400", "1.2.3", "1.5", "1.5 B"):
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            parse_size(bad)
    assert format_bytes(3 * 2**30) == "3.00 GiB" and format_bytes(512) == "512 B"


@pytest.mark.parametrize("bad, message", [
    (["--model", "bert-huge"], "unknown model 'bert-huge'"),
    (["--model", "/nonexistent/config.json"], "does not exist"),
    (["--budget", "16 gigs"], "cannot read size '16 gigs'"),
    (["--budget", "0.5"], "size '0.5' is less than one byte"),
    (["--budget", "1e400"], "size '1e400' is more than"),
    (["--seq", "513"], "longer than bert-base's 512 positions"),
    (["--model", "vit-base", "--seq", "100"], "(patches per side)"),
    (["--plot", "chart.jpg"], "PNG"),
    (["--dtype", "int8"], "invalid choice"),
    (["--batch", "0"], "positive integer"),
    (["--dropout", "1.5"], "dropout must be in [0, 1)"),
])
def test_bad_profile_arguments_exit_2_with_a_message(bad, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["profile", *bad])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error" in err and message in err
    assert err.startswith("usage: leanact profile"), err  # the subcommand's usage, not the top level's


def test_config_json_without_model_type(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(SystemExit) as exc:
        main(["profile", "--model", str(tmp_path / "config.json")])
    assert exc.value.code == 2 and "no \"model_type\"" in capsys.readouterr().err


# -- `leanact layers`: one BERT-style encoder layer, torch.nn modules vs leanact drop-ins ----------
LAYERS_SMALL = ["layers", "--hidden", "64", "--heads", "4", "--seq", "32", "--batch", "2", "--dtype", "bf16",
                "--repeats", "1"]


def test_layers_json_small(capsys, monkeypatch):
    monkeypatch.setattr("os.getloadavg", lambda: (1000.0, 0.0, 0.0))  # a busy machine: timings warn
    assert main(LAYERS_SMALL + ["--json"]) == 0
    captured = capsys.readouterr()
    assert "OMP_NUM_THREADS=1" in captured.err
    out = json.loads(captured.out)
    plain, lean = out["modes"]
    assert plain["name"] == "torch.nn" and lean["name"] == "leanact"
    # bf16 HF-eager-style layer on the CPU: 36 + 6as/h B/sbh plus LayerNorm statistics (see test_meter).
    assert plain["per_sbh"] == 36 + 6 * 4 * 32 / 64 + 8 / 64  # + 2 LayerNorms x (mean, rstd) in bf16
    assert lean["bytes_per_layer"] < plain["bytes_per_layer"]
    assert lean["by_op"].get("Gelu", 0) == 0 and lean["by_op"].get("NativeLayerNorm", 0) == 0


def test_layers_table_small(capsys):
    assert main(LAYERS_SMALL) == 0
    text = capsys.readouterr().out
    assert "total per layer" in text and "leanact" in text and "B/sbh" in text
    assert max(map(len, text.splitlines())) <= 80 and "…" not in text, text


def test_layers_repeats_0_measures_memory_only(capsys, monkeypatch):
    monkeypatch.setattr("os.getloadavg", lambda: (1000.0, 0.0, 0.0))  # no timing: no warning
    out = _json(capsys, LAYERS_SMALL[:-1] + ["0"])
    assert all(m["step_ms"] is None and m["bytes_per_layer"] > 0 for m in out["modes"])
    assert main(LAYERS_SMALL[:-1] + ["0"]) == 0
    captured = capsys.readouterr()
    assert "not measured (--repeats 0)" in captured.out and "busy" not in captured.err


@pytest.mark.parametrize("bad", [["--hidden", "65"], ["--seq", "0"], ["--dropout", "1.5"], ["--dtype", "int8"],
                                 ["--batch", "two"]])
def test_bad_layers_arguments_exit_2_with_a_message(bad, capsys):
    with pytest.raises(SystemExit) as exc:
        main(LAYERS_SMALL + bad)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error" in err and err.startswith("usage: leanact layers"), err


@pytest.mark.slow
def test_console_script_entry_point():
    out = subprocess.run([sys.executable, "-m", "leanact.cli.main", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "profile" in out.stdout and "layers" in out.stdout
    from importlib.metadata import entry_points

    scripts = {e.name: e.value for e in entry_points(group="console_scripts")}
    if "leanact" not in scripts:
        pytest.skip("leanact is not pip-installed here (pyproject.toml declares the script)")
    assert scripts["leanact"] == "leanact.cli.main:main"
    exe = shutil.which("leanact")
    if exe is not None:
        out = subprocess.run([exe, "profile", "--help"], capture_output=True, text=True)
        assert out.returncode == 0 and "--budget" in out.stdout and "--model" in out.stdout


@pytest.fixture(scope="module")
def bloom_result(tmp_path_factory):
    """run_profile of a tiny Bloom (BloomGelu: left by leanact), memory only."""
    path = tmp_path_factory.mktemp("bloom") / "config.json"
    path.write_text(json.dumps(dict(model_type="bloom", hidden_size=32, n_layer=2, n_head=4, vocab_size=100)))
    return run_profile(ProfileConfig(str(path), seq=16, batch=1, repeats=0))


def test_partial_modes_are_labelled_and_the_summary_is_shown(bloom_result, tmp_path, capsys, monkeypatch):
    """What leanact left is under the table and in the labels; --json carries the summary."""
    modes = {m.name: m for m in bloom_result.modes}
    assert modes["HF eager"].summary is None and modes["HF eager"].label == "HF eager"
    lean = modes["leanact recompute"]
    assert lean.label == "leanact recompute (partial: BloomGelu left)"
    assert lean.summary["left_in_layers"] == ["BloomGelu"]
    assert ["transformer.h.0.mlp.gelu_impl", "BloomGelu", "no lean equivalent (not covered)"] in lean.summary["left"]
    monkeypatch.setattr("leanact.cli.profile.run_profile", lambda cfg, progress=None: bloom_result)
    argv = ["profile", "--model", bloom_result.config.model, "--seq", "16", "--repeats", "0"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "leanact recompute (partial:" in text and "BloomGelu left)" in text  # (wrapped in its cell)
    assert "Left by leanact" in text and "transformer.h.0.mlp.gelu_impl" in text
    assert "no lean equivalent" in re.sub(r"\s+", " ", text)
    assert max(map(len, text.splitlines())) <= 80 and "…" not in text, text
    out = _json(capsys, argv)
    recompute = next(m for m in out["modes"] if m["name"] == "leanact recompute")
    assert recompute["summary"] == lean.summary and recompute["label"] == lean.label


def test_complete_modes_keep_their_name(tiny_result):
    lean = next(m for m in tiny_result.modes if m.name == "leanact recompute")
    assert lean.label == "leanact recompute" and lean.summary["left_in_layers"] == []
    assert lean.summary["attention"][0][2] == "leanact (recompute)"


@pytest.mark.slow
def test_budget_gives_the_longest_sequence_with_host_memory(tmp_path, capsys, monkeypatch):
    """--budget also searches the longest sequence whose whole step fits on CUDA, for leanact.patch with
    each of LONGEST_CANDIDATES on every layer; offloading every layer's input needs pinned host memory,
    which is reported apart from the GPU peak."""
    from leanact.cli.profile import LONGEST_CANDIDATES
    from leanact.estimate.maximize import reserve_for, step_estimate

    cfg = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=100,
               max_position_embeddings=1 << 20)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    budget = 160 << 20
    _no_step_search(monkeypatch)
    out = _json(capsys, ["profile", "--model", str(path), "--seq", "32", "--batch", "1", "--repeats", "0",
                         "--budget", "160MiB", "--dtype", "bf16"])
    longest = out["longest"]
    assert set(longest["by_strategy"]) == set(LONGEST_CANDIDATES)
    reached = longest["by_strategy"]
    assert reached["offload+recompute+tiled_mlp"] > reached["full+tiled_mlp"] > reached["lean"] > 0
    assert longest["strategy"] == "offload+recompute+tiled_mlp" and longest["seq"] == max(reached.values())
    assert longest["host"] > 0 and longest["reserve"] == reserve_for(budget)
    geo = resolve(str(path))
    with torch.device("meta"):
        model = leanact.patch(geo.build(geo.layers, "sdpa", torch.bfloat16, None, None)).train()
    x = geo.batch_inputs(1, 32, torch.bfloat16)
    at, after = (step_estimate(model, x, longest["strategy"], "seq", n, device="cuda")
                 for n in (longest["seq"], longest["seq"] + 128))
    assert at.peak == longest["peak"] <= budget - longest["reserve"] < after.peak
    assert at.host == longest["host"]


@pytest.mark.slow
@pytest.mark.parametrize("native", [True, False])
def test_default_dtype_follows_the_cpus_bf16_matmul(native, bert_json, capsys, monkeypatch):
    """No --dtype: bf16 where the CPU multiplies bf16 natively (AVX512-BF16, AMX), else fp32 (a
    bf16 step there can take 70x an fp32 one: leanact.ops.cpu_gemm), said on stderr; an explicit
    --dtype is kept either way."""
    import leanact.cli.profile as P

    monkeypatch.setattr(P, "native_16bit_gemm", lambda dtype: native)
    argv = ["profile", "--model", bert_json, "--seq", str(S), "--batch", "2", "--repeats", "0"]
    assert main(argv + ["--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["config"]["dtype"] == ("bf16" if native else "fp32")
    assert ("no native bf16 matrix multiply" in captured.err) is not native
    assert main(argv + ["--json", "--dtype", "bf16"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["config"]["dtype"] == "bf16" and "native" not in captured.err
    layers = ["layers", "--hidden", "64", "--heads", "4", "--seq", "32", "--repeats", "0", "--json"]
    assert main(layers) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["config"]["dtype"] == ("bf16" if native else "fp32")
    assert ("leanact layers: fp32" in captured.err) is not native


def test_context_parallel_goes_to_the_longest_sequence_search(tmp_path, capsys, monkeypatch):
    """--context-parallel P: the longest-sequence search predicts one of P ranks (the estimator's own
    test: tests/test_parallel_context.py), in multiples of lcm(128, P); without --budget it is refused."""
    from types import SimpleNamespace

    from leanact.cli import profile as profile_cmd

    seen = {}

    def fake_maximize(model, inputs, budget, what, **kw):
        seen.update(kw)
        return SimpleNamespace(value=4096, strategy="full+tiled_mlp", estimate=None, host=0, reserve=1 << 20,
                               by_strategy={"full+tiled_mlp": 4096})

    monkeypatch.setattr(sys.modules["leanact.estimate.maximize"], "maximize", fake_maximize)
    cfg = profile_cmd.ProfileConfig(model="llama-1b-like", seq=128, batch=1, budget=80 << 30, context_parallel=6)
    found = profile_cmd.longest_sequence(cfg)
    assert seen["context_parallel"] == 6 and seen["multiple"] == 384 and found["seq"] == 4096
    assert "on each of 6 ranks (context parallelism)" in profile_cmd.longest_text(found, cfg)
    with pytest.raises(SystemExit) as exc:
        main(["profile", "--context-parallel", "2"])
    assert exc.value.code == 2 and "--context-parallel goes with --budget" in capsys.readouterr().err
