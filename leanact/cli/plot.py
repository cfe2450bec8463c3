"""`leanact profile --plot FILE.png`: stacked bars of what one layer keeps, by role, one bar per mode."""
from __future__ import annotations

from .profile import ProfileResult, dropout_label
from .roles import COLOURS, ROLES

PLOT_EXTRA = 'pip install "leanact[plot]"'


def missing_matplotlib() -> str | None:
    """Why ``--plot`` cannot work here (matplotlib is not installed), or None."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return f"--plot needs matplotlib, which is not installed: {PLOT_EXTRA} (or pip install matplotlib)"
    return None


def plot(result: ProfileResult, path: str) -> None:
    """Write a PNG bar chart (matplotlib, Agg backend): per-layer B/sbh by role (attention, linear
    inputs, GELU / activation, norms, dropout, other; the same colour for a role in every bar), one
    bar per mode, each labelled with its B/sbh and MiB per layer at the profiled batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg, g = result.config, result.geometry
    sbh = cfg.seq * g["hidden"]
    names = [m.name for m in result.modes]
    present = [r for r in ROLES if any(m.by_role.get(r, 0) for m in result.modes)]
    fig, ax = plt.subplots(figsize=(9.5, 5))
    bottom = [0.0] * len(names)
    for role in present:
        values = [m.by_role.get(role, 0) / sbh for m in result.modes]
        ax.bar(names, values, bottom=bottom, label=role, color=COLOURS[role])
        bottom = [b + v for b, v in zip(bottom, values)]
    for x, m in enumerate(result.modes):
        ax.annotate(f"{m.per_sbh:.2f} B/sbh\n{m.layer_bytes / 2**20:.2f} MiB/layer", (x, m.per_sbh),
                    ha="center", va="bottom", fontsize="small")
    ax.set_ylim(0, max(m.per_sbh for m in result.modes) * 1.2)
    ax.set_ylabel("kept per layer / (s·b·h)  [B/sbh]")
    ax.set_title(f"{g['name']} ({g['model_class']}): s={cfg.seq}, b={cfg.batch}, {cfg.precision}, "
                 f"{dropout_label(result)}\nkept for backward per layer, by role (MiB per layer at b={cfg.batch})",
                 fontsize="medium")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
