"""``Plan.explain()`` for a planned model: a rich table of the choice per layer."""
from __future__ import annotations

from .dp import predict, transient

__all__ = ["explain_table", "fmt_bytes"]


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def explain_table(plan, title: str | None = None):
    from rich.table import Table

    costs = plan.costs
    peak, extra, kept = predict(costs, plan.choices)
    lean_time = sum(layer.by_strategy["lean"].time for layer in costs.layers)
    budget = "" if plan.budget is None else f", budget {fmt_bytes(plan.budget)}"
    tab = Table(title=title or f"leanact plan: predicted peak {fmt_bytes(peak)}{budget}")
    for col in ("layer", "strategy", "kept (device)", "offloaded", "backward transient", "extra time"):
        tab.add_column(col, justify="left" if col in ("layer", "strategy") else "right")
    for i, (name, s) in enumerate(zip(plan.layers, plan.choices)):
        c = costs.layers[i].by_strategy[s]
        tab.add_row(name, s, fmt_bytes(kept[i]), fmt_bytes(c.offloaded) if c.offloaded else "",
                    fmt_bytes(transient(costs, i, s)), f"+{c.extra_time * 1e3:.2f} ms")
    tab.add_row("outside the layers", "", fmt_bytes(costs.outside), "", "", "", style="dim")
    ratio = f" ({extra / lean_time:+.1%} of the layers' lean time)" if lean_time > 0 else ""
    tab.add_row("total", "", fmt_bytes(costs.outside + sum(kept)), "", f"peak {fmt_bytes(peak)}",
                f"+{extra * 1e3:.2f} ms{ratio}", style="bold")
    return tab
