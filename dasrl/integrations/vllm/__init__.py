"""vLLM integration: the DAS drafter serving vLLM's V1 speculative decoding (vLLM 0.24-0.33).

    from vllm import LLM
    llm = LLM(model, speculative_config={"method": "custom_class",
                                         "model": "dasrl.integrations.vllm.DASProposer",
                                         "num_speculative_tokens": 8},
              additional_config={"dasrl": {"window": 8, "policy": "das"}})   # optional

See docs/vllm.md. Importing this package does not import vLLM; it refuses an installed vLLM outside
0.24-0.33 (version.check_supported: 0.34 removed custom_class) with an error naming both.
"""

from dasrl.integrations.vllm.version import UnsupportedVLLM, check_supported

check_supported()

from dasrl.integrations.vllm.config import VLLMDrafterConfig
from dasrl.integrations.vllm.proposer import (DASProposer, DASWorkerExtension, dasrl_end_step, dasrl_stats,
                                              install_runner_hook)
from dasrl.integrations.vllm.tracker import BatchDrafter, DrafterStats, match_capped, proposer_policy

__all__ = ["BatchDrafter", "UnsupportedVLLM", "check_supported", "DASProposer", "DASWorkerExtension", "DrafterStats", "VLLMDrafterConfig",
           "dasrl_end_step", "dasrl_stats", "install_runner_hook", "match_capped", "proposer_policy"]
