"""The lab's figures: matplotlib on the Agg backend, PNGs written atomically."""

from __future__ import annotations

import os
from pathlib import Path

from dasrl.atomic import atomic_write


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | os.PathLike, *, dpi: int = 100, tight: bool = True) -> Path:
    """Write a matplotlib figure as PNG, atomically, and close it (also when the write fails)."""
    try:
        return atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=dpi,
                                                        **({"bbox_inches": "tight"} if tight else {})))
    finally:
        pyplot().close(fig)
