"""Timeline pictures of simulated partition schedules: one lane (row) per stream.

A panel shows one schedule of one partition: the compute stream (its kernels in order, launch
gaps in light grey) and the communication stream (the collective, from its launch to its end),
on a time axis in microseconds. Panels drawn side by side share the time axis, so the chosen
schedule and the sequential one compare at a glance.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kareus_fx.cost_models.simulator import Segment

__all__ = ["TimelinePanel", "comm_intervals_s", "timeline_png"]

_COLORS = {"compute": "tab:blue", "memory": "tab:orange", "gap": "0.85", None: "tab:purple"}
_COMM_COLOR = "tab:red"


@dataclass(frozen=True)
class TimelinePanel:
    """One schedule to draw: a title and the simulator's segments of it."""

    title: str
    segments: Sequence[Segment]


def comm_intervals_s(segments: Sequence[Segment]) -> list[tuple[float, float]]:
    """The spans during which the collective runs (consecutive segments merged)."""
    spans: list[tuple[float, float]] = []
    for seg in segments:
        if not seg.comm:
            continue
        if spans and abs(spans[-1][1] - seg.start_s) <= 1e-15:
            spans[-1] = (spans[-1][0], seg.end_s)
        else:
            spans.append((seg.start_s, seg.end_s))
    return spans


def _compute_bars(segments: Sequence[Segment]) -> list[tuple[float, float, str]]:
    """(start, end, kernel name or "gap") of the compute stream, consecutive pieces of one
    kernel merged (the simulator splits a kernel where the collective starts or ends)."""
    bars: list[tuple[float, float, str]] = []
    for seg in segments:
        if seg.compute is None:
            continue
        if bars and bars[-1][2] == seg.compute and abs(bars[-1][1] - seg.start_s) <= 1e-15:
            bars[-1] = (bars[-1][0], seg.end_s, seg.compute)
        else:
            bars.append((seg.start_s, seg.end_s, seg.compute))
    return bars


def timeline_png(panels: Sequence[TimelinePanel], bound_of: Callable[[str], str | None], title: str = "") -> bytes:
    """A PNG with ``panels`` side by side; ``bound_of(kernel name)`` gives "compute" or
    "memory" (the colour of the kernel's bar)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    end_us = max((seg.end_s for p in panels for seg in p.segments), default=1e-6) * 1e6
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 2.4), dpi=100, squeeze=False)
    try:
        for ax, panel in zip(axes[0], panels):
            for start, end, name in _compute_bars(panel.segments):
                color = _COLORS["gap"] if name == "gap" else _COLORS.get(bound_of(name), _COLORS[None])
                ax.broken_barh(
                    [(start * 1e6, (end - start) * 1e6)], (1.6, 0.8), facecolors=color, edgecolor="white", linewidth=0.3
                )
            for start, end in comm_intervals_s(panel.segments):
                ax.broken_barh([(start * 1e6, (end - start) * 1e6)], (0.6, 0.8), facecolors=_COMM_COLOR)
            ax.set_xlim(0, end_us * 1.02)
            ax.set_ylim(0.4, 2.6)
            ax.set_yticks([1.0, 2.0], ["comm stream", "compute stream"])
            ax.set_xlabel("time (µs)")
            ax.set_title(panel.title, fontsize=9)
            ax.grid(axis="x", alpha=0.3)
        handles = [
            Patch(color=_COLORS["compute"], label="compute-bound kernel"),
            Patch(color=_COLORS["memory"], label="memory-bound kernel"),
            Patch(color=_COLORS["gap"], label="launch gap"),
            Patch(color=_COMM_COLOR, label="collective"),
        ]
        fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8, frameon=False)
        if title:
            fig.suptitle(title, fontsize=10)
        fig.tight_layout(rect=(0, 0.1, 1, 1))
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png")
        return buffer.getvalue()
    finally:
        plt.close(fig)
