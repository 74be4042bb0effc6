"""A minimal GRPO update: group-normalised advantages, token-mean policy-gradient loss, one step.

On-policy with a single update per batch, the clipped ratio is 1, so the GRPO gradient is the
advantage-weighted log-likelihood gradient. Only the top `train_layers` decoder layers (and the final
norm) are trained: on 2 CPU cores a full backward of a 135M model would dominate the demo's time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

import numpy as np
import torch


@dataclass(frozen=True)
class GRPOConfig:
    """The policy update of the demo."""

    lr: float = 1e-5
    """AdamW learning rate."""
    train_layers: int = 2
    """Top decoder layers trained (the rest stay frozen)."""
    micro_batch: int = 8
    """Sequences per backward pass."""


def advantages(rewards: Sequence[float], groups: Sequence[Hashable]) -> np.ndarray:
    r = np.asarray(rewards, dtype=np.float64)
    adv = np.zeros_like(r)
    for g in set(groups):
        idx = np.asarray([i for i, x in enumerate(groups) if x == g])
        adv[idx] = (r[idx] - r[idx].mean()) / (r[idx].std() + 1e-4)
    return adv


class GRPOTrainer:
    def __init__(self, model: torch.nn.Module, config: GRPOConfig = GRPOConfig()) -> None:
        self.model, self.config = model, config
        layers = model.get_decoder().layers
        for p in model.parameters():
            p.requires_grad_(False)
        trained = list(layers[-config.train_layers:]) + [model.get_decoder().norm] if config.train_layers else []
        params = [p for m in trained for p in m.parameters()]
        for p in params:
            p.requires_grad_(True)
        self.opt = torch.optim.AdamW(params, lr=config.lr) if params else None

    def step(self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
             adv: np.ndarray) -> float:
        """One update; returns the loss."""
        if self.opt is None:
            return 0.0
        self.model.train()
        n_tokens = max(1, sum(len(c) for c in completions))
        total = 0.0
        self.opt.zero_grad()
        for s in range(0, len(prompts), self.config.micro_batch):
            idx = range(s, min(s + self.config.micro_batch, len(prompts)))
            seqs = [list(prompts[i]) + list(completions[i]) for i in idx]
            width = max(map(len, seqs))
            ids = torch.zeros(len(seqs), width, dtype=torch.long)  # [b, L] right-padded
            mask = torch.zeros(len(seqs), width, dtype=torch.long)
            for j, sq in enumerate(seqs):
                ids[j, : len(sq)] = torch.tensor(sq)
                mask[j, : len(sq)] = 1
            logp = torch.log_softmax(self.model(input_ids=ids, attention_mask=mask).logits.float(), -1)  # [b, L, V]
            loss = torch.zeros(())
            for j, i in enumerate(idx):
                p, c = len(prompts[i]), len(completions[i])
                if c == 0:
                    continue
                target = torch.tensor(completions[i])
                lp = logp[j, p - 1 : p - 1 + c].gather(-1, target[:, None]).squeeze(-1)  # [c]
                loss = loss - float(adv[i]) * lp.sum() / n_tokens
            loss.backward()
            total += float(loss.detach())
        self.opt.step()
        self.model.eval()
        return total
