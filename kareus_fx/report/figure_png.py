"""One matplotlib figure drawn off-screen (Agg) and returned as PNG bytes, for the HTML reports."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

__all__ = ["figure_png"]


def figure_png(draw: Callable[[Any], None], figsize: tuple[float, float], dpi: int = 110) -> bytes:
    """Call ``draw(ax)`` on a fresh figure's one axes; the figure is closed whatever happens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=figsize, dpi=dpi)
    try:
        draw(ax)
        buffer = io.BytesIO()
        fig.tight_layout()
        fig.savefig(buffer, format="png")
        return buffer.getvalue()
    finally:
        plt.close(fig)
