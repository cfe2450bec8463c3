"""``Plan.explain()`` for a planned model: a rich table of the choice per layer."""
from __future__ import annotations

from leanact._format import compact_table, format_bytes, format_in, unit_for

from .dp import predict, transient

__all__ = ["explain_table", "fmt_bytes"]


fmt_bytes = format_bytes


def explain_table(plan, title: str | None = None):
    """Per layer: strategy, bytes kept on the device, offloaded, the backward transient, extra time;
    then what is kept outside the layers and the totals. Fits 80 columns (units in the headers)."""
    costs = plan.costs
    peak, extra, kept = predict(costs, plan.choices)
    lean_time = sum(layer.by_strategy["lean"].time for layer in costs.layers)
    budget = "" if plan.budget is None else f", budget {fmt_bytes(plan.budget)}"
    rows = []
    for i, (name, s) in enumerate(zip(plan.layers, plan.choices)):
        c = costs.layers[i].by_strategy[s]
        rows.append((name, s, kept[i], c.offloaded, transient(costs, i, s), c.extra_time))
    offloads = any(r[3] for r in rows)
    ratio = f" ({extra / lean_time:+.1%} of the layers' lean time)" if lean_time > 0 else ""
    tab = compact_table(title or f"leanact plan: predicted peak {fmt_bytes(peak)}{budget}", (
        "kept: on the device for backward;" + (" offloaded: to host memory;" if offloads else "")
        + " transient: the peak while the layer's "
        f"backward runs (recomputed or fetched tensors); extra: time over the lean layer. Total extra time "
        f"{extra * 1e3:+.2f} ms{ratio}."))
    units = {col: unit_for([r[j] for r in rows] + ([costs.outside + sum(kept)] if col == "kept" else []))
             for j, col in ((2, "kept"), (3, "offloaded"), (4, "transient")) if col != "offloaded" or offloads}
    tab.add_column("layer", overflow="fold")
    tab.add_column("strategy", overflow="fold")
    for col, (unit, _) in units.items():
        tab.add_column(f"{col}\n{unit}", justify="right", no_wrap=True)
    tab.add_column("extra\nms", justify="right", no_wrap=True)
    blank = [""] * offloads
    for name, s, k, off, tr, t in rows:
        offloaded = [format_in(off, units["offloaded"][1]) if off else ""] * offloads
        tab.add_row(name, s, format_in(k, units["kept"][1]), *offloaded, format_in(tr, units["transient"][1]),
                    f"+{t * 1e3:.2f}")
    tab.add_row("outside the layers", "", format_in(costs.outside, units["kept"][1]), *blank, "", "", style="dim")
    tab.add_row("total", "", format_in(costs.outside + sum(kept), units["kept"][1]), *blank, "",
                f"+{extra * 1e3:.2f}", style="bold")
    return tab
