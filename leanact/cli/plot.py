"""`leanact profile --plot FILE.png`: stacked bars of what one layer keeps, per autograd op, per mode."""
from __future__ import annotations

from .profile import ProfileResult

_MAX_OPS = 9  # the largest ops get their own colour, the rest are summed as "other"


def plot(result: ProfileResult, path: str) -> None:
    """Write a PNG bar chart (matplotlib, Agg backend): per-layer B/sbh by op, one bar per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg, g = result.config, result.geometry
    sbh = cfg.seq * g["hidden"]
    totals: dict[str, int] = {}
    for m in result.modes:
        for op, n in m.by_op.items():
            totals[op] = totals.get(op, 0) + abs(n)
    top = sorted(totals, key=totals.get, reverse=True)[:_MAX_OPS]
    names = [m.name for m in result.modes]
    fig, ax = plt.subplots(figsize=(8, 5))
    bottom = [0.0] * len(names)
    series = [(op, [m.by_op.get(op, 0) / sbh for m in result.modes]) for op in top]
    other = [sum(n for op, n in m.by_op.items() if op not in top) / sbh for m in result.modes]
    if any(other):
        series.append(("other", other))
    for op, values in series:
        ax.bar(names, values, bottom=bottom, label=op)
        bottom = [b + v for b, v in zip(bottom, values)]
    for x, m in enumerate(result.modes):
        ax.annotate(f"{m.per_sbh:.1f}", (x, m.per_sbh), ha="center", va="bottom")
    ax.set_ylabel("bytes kept per layer / (s·b·h)")
    ax.set_title(f"{g['name']}: s={cfg.seq}, {cfg.dtype}, kept for backward per layer by autograd op")
    ax.legend(fontsize="small", loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
