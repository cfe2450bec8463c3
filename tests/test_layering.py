"""The package's layers: no module imports from a layer above its own, at import time or inside a
function. Lowest first; a package may import from its own layer and the ones below."""
import ast
import json
import pathlib
import subprocess
import sys

import pytest

import leanact

LAYERS = [
    ["_format", "_local", "_version", "saved"],
    ["ops"],
    ["recompute", "functional"],
    ["nn", "memory"],
    ["patching"],
    ["lossy"],
    ["strategies"],
    ["planner", "parallel", "models"],
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


@pytest.mark.slow
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


# -- import circles inside leanact.ops ------------------------------------------------------------

def _modules() -> dict[str, tuple[pathlib.Path, bool]]:
    """Every module of leanact: dotted name -> (file, whether it is a package's __init__)."""
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        is_package = rel.name == "__init__"
        out[".".join(rel.parts[:-1] if is_package else rel.parts)] = (path, is_package)
    return out


def _import_graph() -> dict[str, set[str]]:
    """module -> the leanact modules its import statements name, at module level or inside a
    function (``from pkg import sub`` names ``pkg.sub`` when that is a module, else ``pkg``). The
    parent packages Python runs first (``leanact/ops/__init__.py`` for ``leanact.ops.x``) are not
    edges: every module of a package would otherwise be in a circle with its ``__init__``."""
    modules = _modules()
    graph = {}
    for module, (path, is_package) in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module.split(".") if is_package else module.split(".")[:-1]
                    base = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for name in names:
                while name not in modules and "." in name:  # import a.b.c where c is not a module
                    name = name.rsplit(".", 1)[0]
                if name in modules and name != module:
                    edges.add(name)
        graph[module] = edges
    return graph


def _circles(graph: dict[str, set[str]], nodes: set[str]) -> list[list[str]]:
    """The strongly connected components of more than one module among ``nodes`` (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v] & nodes):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize("where", ["leanact.ops", "leanact"])
def test_no_import_circle(where):
    """One op = its autograd Function, its launchers and its kernels; below them the dispatch layer.
    No module of leanact.ops, nor of the whole package, imports (at import time or inside a function)
    one that imports it back (patching's rules and steps, the planner and recompute included)."""
    graph = _import_graph()
    nodes = {m for m in graph if m == where or m.startswith(where + ".")}
    circles = _circles(graph, nodes)
    detail = [f"{m} -> {', '.join(sorted(graph[m] & set(c)))}" for c in circles for m in c]
    assert not circles, f"{len(circles)} import circle(s) in {where}:\n" + "\n".join(detail)


#: What leanact/ops/triton/dispatch.py may name in an import statement (module level or in a
#: function): no leanact module at all. The module the kernels build on, which it needs on the first
#: kernel call, it loads by name (importlib); each op's kernel module is loaded by the name its
#: launchers pass.
DISPATCH_MAY_IMPORT: set[str] = set()
#: The leanact modules dispatch.py names as strings (loaded through importlib, never at import
#: time): all in leanact/ops/triton/, none an op's module (leanact.ops.dropout, .gelu, ...).
DISPATCH_LOADS_BY_NAME_UNDER = "leanact.ops.triton."


def test_the_dispatch_layer_imports_no_op_and_no_kernel_module():
    graph = _import_graph()
    assert graph["leanact.ops.triton.dispatch"] <= DISPATCH_MAY_IMPORT, (
        f"leanact/ops/triton/dispatch.py imports {sorted(graph['leanact.ops.triton.dispatch'] - DISPATCH_MAY_IMPORT)}")
    tree = ast.parse((ROOT / "ops" / "triton" / "dispatch.py").read_text())
    named = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
             and node.value.startswith("leanact.")}
    assert all(n.startswith(DISPATCH_LOADS_BY_NAME_UNDER) and n in graph for n in named), sorted(named)


def _kernel_module(module: str) -> bool:
    """A module of Triton kernels: an op's (``kernels``, ``kernels16``, ``kernels32``) or the ones they
    all build on (``leanact.ops.triton.common``, ``leanact.ops.triton.hash``)."""
    leaf = module.rsplit(".", 1)[1]
    return module.startswith("leanact.ops.") and (leaf.startswith("kernels")
                                                  or module in ("leanact.ops.triton.common", "leanact.ops.triton.hash"))


def test_the_launch_layer_imports_no_leanact_module():
    """leanact/ops/triton/launch.py (how the kernel modules launch) sits beside the dispatch layer, at
    the bottom: it imports torch and Triton only, and only kernel modules import it."""
    graph = _import_graph()
    assert graph["leanact.ops.triton.launch"] == set(), sorted(graph["leanact.ops.triton.launch"])
    users = {m for m, deps in graph.items() if "leanact.ops.triton.launch" in deps}
    assert users and all(_kernel_module(m) for m in users), sorted(users)


_IMPORT_DISPATCH = """
import importlib.util, json, sys, types
spec = importlib.util.find_spec("leanact")
stub = types.ModuleType("leanact")  # without leanact/__init__.py, which imports every part
stub.__path__, stub.__file__ = list(spec.submodule_search_locations), spec.origin
sys.modules["leanact"] = stub
import leanact.ops.triton.dispatch
print(json.dumps(sorted(m for m in sys.modules if m.startswith("leanact"))))
"""


@pytest.mark.slow
def test_importing_the_dispatch_layer_loads_nothing_else_of_leanact():
    out = subprocess.run([sys.executable, "-c", _IMPORT_DISPATCH], capture_output=True, text=True, cwd=ROOT.parent,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded == ["leanact", "leanact.ops", "leanact.ops.triton", "leanact.ops.triton.dispatch"], loaded


def test_the_estimator_knows_no_op_inside():
    """leanact.estimate imports no private name of leanact.ops and assigns no attribute of what it
    imports from there: what an op does on fake tensors is the op's own rule, entered through
    leanact.ops.fake_rules."""
    wrong = []
    for path in sorted((ROOT / "estimate").rglob("*.py")):
        tree = ast.parse(path.read_text())
        from_ops = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("leanact.ops"):
                for a in node.names:
                    if a.name.startswith("_"):
                        wrong.append(f"{path.name}:{node.lineno} imports {node.module}.{a.name}")
                    from_ops.add(a.asname or a.name)
            elif isinstance(node, ast.Import):
                from_ops.update(a.asname or a.name for a in node.names if a.name.startswith("leanact.ops"))
        for node in ast.walk(tree):
            targets = (node.targets if isinstance(node, ast.Assign) else [node.target]
                       if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for t in targets:
                for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name) and el.value.id in from_ops:
                        wrong.append(f"{path.name}:{node.lineno} assigns {el.value.id}.{el.attr}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                    and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id in from_ops):
                wrong.append(f"{path.name}:{node.lineno} setattr on {node.args[0].id}")
    assert not wrong, "\n".join(wrong)


def _op_folder(module: str) -> str | None:
    """The op folder a module of leanact.ops belongs to (``leanact.ops.norms.verdict`` -> ``norms``);
    None outside one (the modules at the top of leanact.ops, the shared ``triton`` package)."""
    parts = module.split(".")
    if len(parts) < 3 or parts[:2] != ["leanact", "ops"] or parts[2] == "triton":
        return None
    return parts[2] if (ROOT / "ops" / parts[2] / "__init__.py").exists() else None


def test_an_op_folder_uses_no_private_name_of_another():
    """An op folder (leanact/ops/<op>/) takes from another op folder only its public names: no
    ``from ..other.x import _name`` and no ``x._name`` on a module imported from there."""
    modules = _modules()
    wrong = []
    for module, (path, is_package) in sorted(modules.items()):
        own = _op_folder(module)
        if own is None:
            continue
        tree = ast.parse(path.read_text())
        aliases = set()  # names bound to a module of another op folder
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else (node.module or "")
                for a in node.names:
                    full = f"{base}.{a.name}"
                    target = full if full in modules else base
                    other = _op_folder(target)
                    if other is None or other == own:
                        continue
                    if a.name.startswith("_"):
                        wrong.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} imports {base}.{a.name}")
                    if full in modules:
                        aliases.add(a.asname or a.name)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    other = _op_folder(a.name)
                    if other is not None and other != own and a.asname:
                        aliases.add(a.asname)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name) and node.value.id in aliases):
                wrong.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} uses {node.value.id}.{node.attr}")
    assert not wrong, "\n".join(wrong)
