"""Write docs/api.md, the reference of every public name, from the package's ``__all__`` lists,
signatures and docstrings.

    python scripts/api_reference.py            # rewrite docs/api.md
    python scripts/api_reference.py --check    # exit 1 if docs/api.md is not what this writes

tests/test_readme.py checks that docs/api.md is current, so a new public name (or a changed
signature or docstring) needs this script run once.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "api.md"
sys.path.insert(0, str(ROOT))  # this checkout's leanact, not another installed copy

#: (module, what a reader looks for there), in reading order: the user-facing calls first.
MODULES = [
    ("leanact", "the top level: patch, estimate, plan"),
    ("leanact.patching", "patching Hugging Face and torch models in place"),
    ("leanact.nn", "drop-in modules"),
    ("leanact.nn.fused", "modules built on recipes"),
    ("leanact.functional", "functional ops"),
    ("leanact.memory", "measuring what autograd keeps"),
    ("leanact.estimate", "predicting a training step's memory"),
    ("leanact.strategies", "per-layer recompute and offload"),
    ("leanact.planner", "choosing strategies under a budget"),
    ("leanact.lossy", "opt-in approximate options"),
    ("leanact.recompute", "recipes instead of kept outputs"),
    ("leanact.parallel", "tensor + sequence parallelism"),
    ("leanact.parallel.meter", "the meter for DTensor models"),
    ("leanact.saved", "the saved-tensor pipeline"),
    ("leanact.ops.triton", "the CUDA kernels' switches"),
]

#: Data (not functions or classes): what they hold. Every public constant needs a line here.
CONSTANTS = {
    "leanact.__version__": "the installed version, a string",
    "leanact.nn.fused.MLP_ACTIVATIONS": "activation names `LeanMLP` accepts",
    "leanact.estimate.CUDA_NOTES": "what `estimate(device=\"cuda\")` models and what it leaves out (the notes an "
                                   "`Estimate` for CUDA carries)",
    "leanact.strategies.LOSSY": "the strategy names that change gradients (`lossy:fp8`, `lossy:int8`): the planner "
                                "uses them only with `allow_lossy=True`",
    "leanact.strategies.DEFAULT_THRESHOLD": "bytes: offload strategies copy saved tensors at least this large to host "
                                            "memory (smaller ones stay on the device)",
    "leanact.strategies.PRESETS": "selective-recompute policy names (`attention`, `pointwise`, `norms`) and what each "
                                  "keeps",
    "leanact.strategies.STRATEGIES": "strategy name → what a layer keeps under it (`lean`, `selective:*`, `offload`, "
                                     "`offload+recompute`, `full`, `lossy:*`)",
    "leanact.lossy.OPTIONS": "the option names of `lossy=`: `fewbit`, `randomized_linear`, `compress`",
    "leanact.parallel.SUPPORTED": "layer class names `parallelize` knows, and the plan it applies to each",
    "leanact.parallel.SUPPORTED_CONTEXT": "model types `context_parallel` takes, and how each one's head reads its "
                                          "labels (causal: shifted, masked: as they are)",
}


def _first_paragraph(doc: str | None) -> str:
    text = inspect.cleandoc(doc or "").split("\n\n")[0].replace("\n", " ").strip()
    text = re.sub(r":(?:func|class|mod|meth|data|attr):`~?([^`]+)`", r"`\1`", text)  # Sphinx roles
    return text.replace("``", "`")


def _signature(obj) -> str:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    params = []
    for p in sig.parameters.values():
        if isinstance(obj, type) and p.name == "self":
            continue
        text = p.name
        if p.kind is p.VAR_POSITIONAL:
            text = "*" + text
        elif p.kind is p.VAR_KEYWORD:
            text = "**" + text
        if p.default is not p.empty:
            default = p.default
            shown = repr(default) if isinstance(default, (str, int, float, bool, type(None), tuple)) else "..."
            text += f"={shown}"
        params.append((p.kind, text))
    out, star = [], False
    for kind, text in params:
        if kind is inspect.Parameter.KEYWORD_ONLY and not star:
            out.append("*")
            star = True
        if kind is inspect.Parameter.VAR_POSITIONAL:
            star = True
        out.append(text)
    return "(" + ", ".join(out) + ")"


def _kind(obj) -> str:
    if inspect.ismodule(obj):
        return "module"
    if inspect.isclass(obj):
        return "class"
    return "function" if callable(obj) else "data"


def _entry(module: str, name: str, obj) -> list[str]:
    qual = f"{module}.{name}"
    kind = _kind(obj)
    if kind == "module":
        return [f"- `{qual}` (module): {_first_paragraph(obj.__doc__)}"]
    if kind == "data":
        if qual not in CONSTANTS:
            raise SystemExit(f"{qual} is public data without a description: add it to CONSTANTS in {__file__}")
        return [f"- `{qual}`: {CONSTANTS[qual]}."]
    doc = _first_paragraph(inspect.getdoc(obj))
    if not doc:
        raise SystemExit(f"{qual} has no docstring: write one (its first paragraph is its line in docs/api.md)")
    return [f"- `{qual}{_signature(obj)}` ({kind}): {doc}"]


def render() -> str:
    lines = ["# API reference", "",
             "Every public name of leanact (the `__all__` of each module below), with its signature and the first",
             "paragraph of its docstring; `help(name)` shows the rest. Generated by "
             "`python scripts/api_reference.py`:", "do not edit by hand.", ""]
    seen: dict[int, str] = {}
    for module, about in MODULES:
        mod = importlib.import_module(module)
        lines += [f"## `{module}`: {about}", "", _first_paragraph(mod.__doc__), ""]
        for name in mod.__all__:
            obj = getattr(mod, name)
            qual = f"{module}.{name}"
            if _kind(obj) in ("function", "class") and id(obj) in seen:
                lines.append(f"- `{qual}`: the same object as `{seen[id(obj)]}`.")
                continue
            if _kind(obj) in ("function", "class"):
                seen[id(obj)] = qual
            lines += _entry(module, name, obj)
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with docs/api.md, write nothing")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        current = OUT.read_text() if OUT.exists() else ""
        if current != text:
            print(f"{OUT} is out of date: run python scripts/api_reference.py", file=sys.stderr)
            return 1
        print(f"{OUT} is current")
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
