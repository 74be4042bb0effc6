"""A minimal GRPO update: group-normalised advantages, token-mean policy-gradient loss, one step.

On-policy with a single update per batch the clipped ratio is 1, so the gradient is the advantage-weighted
log-likelihood gradient. Only the top `train_layers` decoder layers (and the final norm) are trained: on 2 CPU
cores a full backward of a 135M model would dominate the demo. The loss is a sum over sequences, so they are
packed by length into micro-batches under a token budget, and the head and log-softmax run only at the
positions that predict a completion token, in chunks, their gradient written by hand (onehot - softmax): the
plain algorithm's gradient up to float rounding (tests/lab/test_grpo.py).
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
    """Most sequences per backward pass."""
    micro_tokens: int = 4096
    """Most padded tokens (sequences x longest prompt+completion-1) per backward pass; a longer one goes alone."""
    head_chunk: int = 1024
    """Completion positions per lm_head + log-softmax pass (bounds the [positions, vocab] memory)."""


def advantages(rewards: Sequence[float], groups: Sequence[Hashable]) -> np.ndarray:
    r = np.asarray(rewards, dtype=np.float64)
    adv = np.zeros_like(r)
    for g in set(groups):
        idx = np.asarray([i for i, x in enumerate(groups) if x == g])
        adv[idx] = (r[idx] - r[idx].mean()) / (r[idx].std() + 1e-4)
    return adv


def micro_batches(lengths: Sequence[int], max_seqs: int, max_tokens: int) -> list[list[int]]:
    """Indices of `lengths` grouped for the update: longest first, each group as many of the next longest as
    fit `max_seqs` and `max_tokens` (group size x its longest length; a longer one goes alone), ties in order."""
    if max_seqs < 1 or max_tokens < 1:
        raise ValueError(f"micro-batch limits must be >= 1, got max_seqs={max_seqs}, max_tokens={max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        g = groups[-1] if groups else None
        if g is not None and len(g) < max_seqs and (len(g) + 1) * lengths[g[0]] <= max_tokens:
            g.append(i)
        else:
            groups.append([i])
    return groups


class GRPOTrainer:
    def __init__(self, model: torch.nn.Module, config: GRPOConfig = GRPOConfig()) -> None:
        self.model, self.config = model, config
        for name in ("final_logit_softcapping", "logit_scale"):
            if getattr(model.config, name, None) not in (None, 1.0):
                raise ValueError(f"GRPOTrainer computes logits as lm_head(hidden); {name}="
                                 f"{getattr(model.config, name)!r} in the model config is not supported")
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
        if not len(prompts) == len(completions) == len(adv):
            raise ValueError(f"step needs one prompt, completion and advantage per sequence; got "
                             f"{len(prompts)}, {len(completions)}, {len(adv)}")
        self.model.train()
        n_tokens = max(1, sum(len(c) for c in completions))
        total = 0.0
        self.opt.zero_grad()
        for idx in self._groups(prompts, completions):
            total += self._micro_batch(idx, prompts, completions, adv, n_tokens)
        self.opt.step()
        self.model.eval()
        return total

    @torch.no_grad()
    def logprobs(self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]) -> np.ndarray:
        """log p(token) of every completion token under the current weights (no temperature), end to end."""
        out: dict[int, np.ndarray] = {}
        head = self.model.get_output_embeddings()
        for idx in self._groups(prompts, completions):
            ids, rows, cols, targets = self._inputs(idx, prompts, completions)
            sel = self.model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[rows, cols]
            lp = torch.cat([torch.log_softmax(head(sel[s:s + self.config.head_chunk]).float(), -1)
                            .gather(-1, targets[s:s + self.config.head_chunk, None]).squeeze(-1)
                            for s in range(0, len(sel), self.config.head_chunk)]).numpy()
            ends = np.cumsum([len(completions[i]) for i in idx])
            out.update(zip(idx, np.split(lp, ends[:-1])))
        return np.concatenate([out[i] for i in sorted(out)]) if out else np.zeros(0, np.float32)

    def _groups(self, prompts, completions) -> list[list[int]]:
        """The sequences with a completion (an empty one adds no loss), as micro-batches of their indices."""
        live = [i for i in range(len(prompts)) if len(completions[i])]
        lengths = [len(prompts[i]) + len(completions[i]) - 1 for i in live]  # the input rows of _inputs
        return [[live[g] for g in group]
                for group in micro_batches(lengths, self.config.micro_batch, self.config.micro_tokens)]

    def _inputs(self, idx: list[int], prompts, completions):
        """The sequences `idx` as one right-padded batch [b, L] (prompt + completion[:-1]: the last
        completion token predicts nothing), and the (row, column) of each position that predicts a
        completion token, with that token."""
        width = max(len(prompts[i]) + len(completions[i]) - 1 for i in idx)
        ids = torch.zeros(len(idx), width, dtype=torch.long)  # [b, L]
        rows, cols, targets = [], [], []
        for j, i in enumerate(idx):
            p, c = len(prompts[i]), len(completions[i])
            if p < 1:
                raise ValueError(f"sequence {i} has an empty prompt; its first completion token has no predictor")
            target = torch.as_tensor(completions[i], dtype=torch.long)
            ids[j, :p] = torch.as_tensor(prompts[i], dtype=torch.long)
            ids[j, p:p + c - 1] = target[:-1]
            rows.append(torch.full((c,), j, dtype=torch.long))
            cols.append(torch.arange(p - 1, p - 1 + c))
            targets.append(target)
        return ids, torch.cat(rows), torch.cat(cols), torch.cat(targets)

    def _micro_batch(self, idx: list[int], prompts, completions, adv, n_tokens: int) -> float:
        """Forward and backward of the sequences `idx`; returns their share of the loss."""
        ids, rows, cols, target = self._inputs(idx, prompts, completions)
        weight = torch.cat([torch.full((len(completions[i]),), -float(adv[i]) / n_tokens, dtype=torch.float64)
                            for i in idx])
        # No attention mask: padding is on the right and attention is causal, so no real position sees it.
        hidden = self.model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state  # [b, L, H]
        sel = hidden[rows, cols]  # [n, H]: the positions that predict completion tokens
        grad, loss = self._head_grad(sel.detach(), target, weight)
        sel.backward(grad)
        return loss

    @torch.no_grad()
    def _head_grad(self, h: torch.Tensor, target: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, float]:
        """loss = sum_k weight_k * log_softmax(lm_head(h_k))[target_k] and d loss / d h, a chunk of positions
        at a time. d loss / d logits_k = weight_k * (onehot(target_k) - softmax_k); the head is frozen."""
        head = self.model.get_output_embeddings()
        grad = torch.empty_like(h)
        loss = 0.0
        for s in range(0, len(h), self.config.head_chunk):
            e = min(s + self.config.head_chunk, len(h))
            t, w = target[s:e], weight[s:e].float()
            logits = head(h[s:e]).float()  # [n, V]
            lse = torch.logsumexp(logits, -1)  # [n]
            lp = logits.gather(-1, t[:, None]).squeeze(-1) - lse
            loss += float((weight[s:e] * lp.double()).sum())
            probs = logits.sub_(lse[:, None]).exp_()  # softmax, in place
            probs.scatter_add_(-1, t[:, None], torch.full((e - s, 1), -1.0))
            probs.mul_(-w[:, None])  # weight * (onehot - softmax)
            grad[s:e] = probs.to(head.weight.dtype) @ head.weight
        return grad, loss
