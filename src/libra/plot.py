"""Pictures of what the planner predicts. matplotlib is optional (``pip install 'libra-remat[plot]'``) and imported
only when a picture is drawn, with the non-interactive Agg backend."""

from __future__ import annotations

from pathlib import Path

from libra.errors import LibraError
from libra.planner.timeline import Timeline
from libra.units import format_bytes

__all__ = ["plot_memory_timeline"]

_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


def _pyplot(what: str):
    try:
        import matplotlib
    except ImportError:
        raise LibraError(
            f"{what}: drawing a picture needs matplotlib, which is not installed. "
            "Fix: pip install 'libra-remat[plot]' (or pip install matplotlib)."
        ) from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def plot_memory_timeline(timeline: Timeline, path, *, title: str = "", dpi: int = 100) -> Path:
    """Draws live bytes over one step, eagerly and under the plan, and writes the picture to ``path``.

    The x axis is the op index of the profiled step; the y axis live bytes in binary units. The picture marks where
    the backward pass begins, the budget, the static bytes, and both peaks.

    Args:
        timeline: from :func:`libra.planner.timeline.memory_timeline`.
        path: where to write; the suffix picks the format (``.png``, ``.svg``, ``.pdf``).
        title: a line above the plot.
        dpi: resolution of raster formats.

    Returns:
        The path written.

    Raises:
        LibraError: matplotlib is not installed, or the file cannot be written.

    Example:
        >>> plot_memory_timeline(memory_timeline(profile, plan), "timeline.png")
        PosixPath('timeline.png')
    """
    plt = _pyplot("libra.plot_memory_timeline")
    top = max(max(timeline.eager_bytes), max(timeline.plan_bytes), timeline.budget_bytes)
    unit, scale = next((u, s) for u, s in _UNITS if top >= 2 * s)
    xs = range(len(timeline.eager_bytes))
    eager = [b / scale for b in timeline.eager_bytes]
    planned = [b / scale for b in timeline.plan_bytes]

    fig, ax = plt.subplots(figsize=(8, 4), dpi=dpi)
    try:
        ax.plot(xs, eager, color="#888888", lw=1.2, label="eager PyTorch")
        ax.plot(xs, planned, color="#1f6fb4", lw=1.6, label="under the plan")
        ax.axhline(timeline.budget_bytes / scale, color="#c0392b", ls="--", lw=1,
                   label=f"budget {format_bytes(timeline.budget_bytes)}")
        ax.axhline(timeline.static_bytes / scale, color="#bbbbbb", ls=":", lw=1,
                   label=f"static {format_bytes(timeline.static_bytes)}")
        if 0 < timeline.first_backward_op < timeline.n_ops:
            ax.axvline(timeline.first_backward_op, color="#444444", lw=0.8)
            ax.text(timeline.first_backward_op, 0.02, " backward \u2192", transform=ax.get_xaxis_transform(),
                    fontsize=8, color="#444444", va="bottom")
            ax.text(timeline.first_backward_op, 0.02, "\u2190 forward ", transform=ax.get_xaxis_transform(),
                    fontsize=8, color="#444444", va="bottom", ha="right")
        for op, curve, color, name in (
            (timeline.eager_peak_op, timeline.eager_bytes, "#888888", "eager peak"),
            (timeline.plan_peak_op, timeline.plan_bytes, "#1f6fb4", "plan peak"),
        ):
            ax.plot([op], [curve[op] / scale], "o", color=color, ms=5)
            ax.annotate(f"{name} {format_bytes(curve[op])}", (op, curve[op] / scale), textcoords="offset points",
                        xytext=(6, 4), fontsize=8, color=color)
        ax.set_xlim(0, timeline.n_ops)
        ax.set_ylim(0, top / scale * 1.12)
        ax.set_xlabel("op index in the step")
        ax.set_ylabel(f"live bytes ({unit})")
        if title:
            ax.set_title(title, fontsize=10)
        ax.legend(loc="upper left", fontsize=8, frameon=False)
        ax.grid(axis="y", color="#eeeeee", lw=0.6)
        fig.tight_layout()
        out = Path(path)
        try:
            fig.savefig(out)
        except OSError as e:
            raise LibraError(f"libra.plot_memory_timeline: cannot write {out} ({e}). Fix: pass a writable path.") \
                from None
    finally:
        plt.close(fig)
    return out
