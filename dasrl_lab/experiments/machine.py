"""What the experiments record about the machine they ran on (a floor below base and collect)."""

from __future__ import annotations

import os


def load_avg() -> list[float]:
    """1/5/15-minute load averages (the machine is shared: timings carry their load)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []
