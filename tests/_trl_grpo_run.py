"""One process of a TRL GRPOTrainer run with dasrl rollouts, for tests/test_trl_multiprocess.py.

    python tests/_trl_grpo_run.py OUT_DIR MODEL_DIR                              # one process
    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/_trl_grpo_run.py OUT_DIR MODEL_DIR

MODEL_DIR: a Hugging Face model folder (tests/test_trl_multiprocess.py: conftest's tiny_chat).

One step of 3 prompts x 4 generations (a global generation batch of 12, split evenly over the processes:
on two, the second prompt's group is split 2 + 2 between them), 16 new tokens at T = 1. Each process writes rank-<i>.json: its completions in the order TRL gave its
prompts, and its process index and count as accelerate saw them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(out: Path, folder: str) -> None:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import datasets
    import torch
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dasrl.engine.engine import EngineConfig
    from dasrl.integrations.trl import dasrl_rollout

    world = int(os.environ.get("WORLD_SIZE", "1"))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    seen: list[list[int]] = []

    def reward(completions, completion_ids, **kw):
        seen.extend(list(c) for c in completion_ids)
        return [float(len(c) % 5) / 5 for c in completion_ids]

    ds = datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": q}] for q in
                                                ("Name a color.", "Say hi.", "Count to 3.")]})
    args = trl.GRPOConfig(output_dir=str(out / "trainer"), per_device_train_batch_size=12 // world,
                          num_generations=4, max_completion_length=16, max_steps=1, learning_rate=1e-5,
                          temperature=1.0, bf16=False, gradient_checkpointing=False, use_cpu=True,
                          report_to="none", seed=0, save_strategy="no", dataloader_num_workers=0)
    # batch_invariant: a row's logits do not depend on the other rows, so 6 + 6 rows == 12 rows bit for bit
    rollout = dasrl_rollout(engine=EngineConfig(batch_invariant=True, num_threads=1))
    trainer = trl.GRPOTrainer(model=model, processing_class=tok, reward_funcs=[reward], args=args,
                              train_dataset=ds, rollout_func=rollout)
    trainer.train()
    acc = trainer.accelerator
    (out / f"rank-{acc.process_index}.json").write_text(json.dumps(
        {"process_index": acc.process_index, "num_processes": acc.num_processes,
         "distributed_type": str(acc.distributed_type), "completions": seen}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
