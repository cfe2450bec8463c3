"""The code of a method, normalised, to recognise Hugging Face modules by what their forward does."""
from __future__ import annotations

import inspect
import re

__all__ = ["forward_body"]


def forward_body(fn) -> tuple[list[str], str] | None:
    """(argument names after self, code of the body without blanks/comments/docstring/spaces)."""
    try:
        src = inspect.getsource(inspect.unwrap(fn))
        params = list(inspect.signature(inspect.unwrap(fn)).parameters)
    except (OSError, TypeError, ValueError):
        return None
    lines = src.splitlines()
    while lines and not lines[0].lstrip().startswith("def "):  # decorators
        lines = lines[1:]
    code, in_doc, head = [], False, True
    for ln in lines:
        s = ln.strip()
        if head:  # the signature, possibly over several lines
            head = not re.search(r"\)\s*(->.*)?:\s*(#.*)?$", s)
            continue
        if in_doc:
            in_doc = not s.endswith(('"""', "'''"))
            continue
        if s.startswith(('"""', "'''")):
            in_doc = not (len(s) > 3 and s.endswith(s[:3]))
            continue
        if not s or s.startswith("#"):
            continue
        code.append(re.sub(r"\s+", "", s.split("#")[0]))
    return params[1:], ";".join(code)
