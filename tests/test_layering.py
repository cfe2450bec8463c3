"""The package's layers: no module imports from a layer above its own, at import time or inside a
function. Lowest first; a package may import from its own layer and the ones below."""
import ast
import pathlib
import subprocess
import sys

import leanact

LAYERS = [
    ["_format", "_version", "saved"],
    ["ops"],
    ["recompute", "functional"],
    ["nn", "memory"],
    ["patching"],
    ["lossy"],
    ["strategies"],
    ["plan", "parallel", "models"],
    ["estimate"],
    ["cli"],
]
ROOT = pathlib.Path(leanact.__file__).parent
LEVEL = {name: i for i, names in enumerate(LAYERS) for name in names}


def _part(module: str) -> str | None:
    """The top-level part of leanact a dotted module name belongs to (None: leanact itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_every_part_has_a_layer():
    parts = {p.stem for p in ROOT.iterdir() if (p.suffix == ".py" and p.stem != "__init__")
             or (p.is_dir() and (p / "__init__.py").exists())}
    assert parts == set(LEVEL), f"give these a layer in LAYERS: {parts ^ set(LEVEL)}"


def _imports(path: pathlib.Path, module: str, is_package: bool):
    """(imported leanact module, line) for every import statement in the file, nested ones included."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from ((a.name, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            if name == "leanact":  # from leanact import nn: the part; from leanact import patch: leanact
                yield from ((f"leanact.{a.name}" if a.name in LEVEL else "leanact", node.lineno) for a in node.names)
            else:
                yield name, node.lineno


def test_no_import_goes_up_a_layer():
    wrong = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        is_package = rel.name == "__init__"
        module = ".".join(rel.parts[:-1] if is_package else rel.parts)
        part = _part(module)
        if part is None:
            continue  # leanact/__init__.py gathers everything
        for name, line in _imports(path, module, is_package):
            if name and name.startswith("leanact"):
                target = _part(name)
                if target is None or LEVEL[target] > LEVEL[part]:
                    wrong.append(f"{path.relative_to(ROOT.parent)}:{line} ({part}) imports {name}")
    assert not wrong, "\n".join(wrong)


_IMPORT_IN_ORDER = """
import importlib, importlib.util, json, sys, types
spec = importlib.util.find_spec("leanact")
stub = types.ModuleType("leanact")  # leanact's parts without leanact/__init__.py, which imports them all
stub.__path__, stub.__file__ = list(spec.submodule_search_locations), spec.origin
sys.modules["leanact"] = stub
seen = {}
for part in json.loads(sys.argv[1]):
    importlib.import_module("leanact." + part)
    seen[part] = sorted({m.split(".")[1] for m in sys.modules if m.startswith("leanact.")})
print(json.dumps(seen))
"""


def test_importing_a_layer_loads_nothing_above_it():
    """In a fresh interpreter, import the parts in layer order: after each, only parts of its layer
    or below are loaded (what each part needs at import time, transitively)."""
    import json

    order = [name for names in LAYERS for name in names]
    out = subprocess.run([sys.executable, "-c", _IMPORT_IN_ORDER, json.dumps(order)], capture_output=True,
                         text=True, cwd=ROOT.parent, timeout=300)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    for part, loaded in seen.items():
        above = [m for m in loaded if LEVEL.get(m, -1) > LEVEL[part]]
        assert not above, f"importing leanact.{part} loads {above}, from layers above it"


def test_patch_lossy_goes_through_the_option_lossy_registers(monkeypatch):
    """patching sits below lossy: ``patch(model, lossy=...)`` calls what leanact.lossy registered."""
    import torch

    import leanact.lossy
    import leanact.patching as patching

    assert patching._OPTIONS["lossy"].apply is leanact.lossy.apply
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
    monkeypatch.setattr(patching, "_OPTIONS", {})
    try:
        leanact.patch(model, lossy="fewbit=2")
    except RuntimeError as e:
        assert "import leanact" in str(e)
    else:
        raise AssertionError("patch(lossy=...) without the option registered must raise")
    assert leanact.summary(model) is None and type(model[1]) is torch.nn.GELU  # left unpatched
