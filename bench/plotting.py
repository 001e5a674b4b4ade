"""How every bench draws its figure: matplotlib on the Agg backend (no display needed), one grid
of axes, then a tight layout, saved as a PNG and closed."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def figure(
    path: Path, *grid: int, dpi: float = 100, tight: bool = True, **subplots: Any
) -> Iterator[tuple[Any, Any]]:
    """``plt.subplots(*grid, **subplots)`` for the ``with`` block, which draws on the axes; then
    the figure is laid out tight (``tight=False`` where it lays itself out, e.g. with
    ``constrained_layout``), saved to ``path`` at ``dpi`` and closed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(*grid, **subplots)
    try:
        yield fig, axes
        if tight:
            fig.tight_layout()
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)
