"""The Hydra overrides that turn DAS on in VeRL 0.9 (docs/verl.md):

    python -m verl.trainer.main_ppo $(python -m dasrl.integrations.verl.recipe) data.train_files=...

The drafter (vLLM's `custom_class` with DASProposer, through `actor_rollout_ref.rollout.engine_kwargs.vllm`;
vLLM's worker imports it by name) and the router (DASLoadBalancer, via `rollout.router_config_path`).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

_ROUTER_YAML = Path(__file__).with_name("router.yaml")  # the router plugin config shipped with the package


@dataclass(frozen=True)
class Recipe:
    """What the overrides set."""

    num_speculative_tokens: int = 16
    """Longest draft per request per engine step (the das policy prices each draft below it)."""
    window: int = 16
    """RL steps of history per problem."""
    policy: str = "das"
    """Draft caps: das (by length class) | fixed (num_speculative_tokens for every request)."""
    router: bool = True
    """Route with DASLoadBalancer (problem-sticky, length-aware) instead of VeRL's stock balancer."""

    def overrides(self) -> list[str]:
        from dasrl.integrations.vllm import check_supported
        check_supported()  # the workers' vLLM must have custom_class (0.24-0.33): say so before a launch
        spec = {"method": "custom_class", "model": "dasrl.integrations.vllm.DASProposer",
                "num_speculative_tokens": self.num_speculative_tokens}
        extra = {"dasrl": {"window": self.window, "policy": self.policy}}
        out = [f"+actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config={_hydra(spec)}",
               f"+actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config={_hydra(extra)}"]
        if self.router:
            out.append(f"actor_rollout_ref.rollout.router_config_path={_ROUTER_YAML}")
        return out


# The paper's math setting (DAS, arXiv 2511.13841): DeepSeek-R1-Distill-Qwen-7B, GRPO with 16 samples,
# 16K responses, on the DSR-sub prompts (a parquet of your own conversion; VeRL's data format).
_PAPER_MATH_7B = [
    "algorithm.adv_estimator=grpo",
    "data.train_files=$HOME/data/dsr_sub/train.parquet", "data.val_files=$HOME/data/dsr_sub/test.parquet",
    "data.train_batch_size=128", "data.max_prompt_length=1024", "data.max_response_length=16384",
    "actor_rollout_ref.model.path=deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
    "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.actor.ppo_mini_batch_size=64",
    "actor_rollout_ref.actor.use_kl_loss=False",
    "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.n=16",
    "actor_rollout_ref.rollout.temperature=1.0", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.7",
    "trainer.n_gpus_per_node=8", "trainer.nnodes=1", "trainer.project_name=dasrl",
    "trainer.experiment_name=das-math-7b",
]


def _hydra(obj) -> str:
    """A value in Hydra's override grammar: {key:value,...} with bare keys, quoted strings."""
    if isinstance(obj, dict):
        return "{" + ",".join(f"{k}:{_hydra(v)}" for k, v in obj.items()) + "}"
    if isinstance(obj, str):
        return "'" + obj.replace("'", "\\'") + "'"
    return json.dumps(obj)


if __name__ == "__main__":  # the overrides, one per line (`--paper-math` puts the paper's math setting first)
    lines = Recipe().overrides()
    print("\n".join(_PAPER_MATH_7B + lines if "--paper-math" in sys.argv[1:] else lines))
