"""How often does last-bit logit noise flip a sampled token? Predicted and measured, for the engine's race.

The model (docs/sampling.md, "Flip probability under logit noise"): the sampler sees the true logits plus iid
noise N(0, sigma^2) per token, and to first order P(flip) = sigma (1 - sum p^2) / sqrt(pi). It ignores flips
of the kept set itself (a top-k / top-p boundary token crossing the cut); `measure` counts everything.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from dasrl.engine import SamplingParams, draw, filtered_probs


def predicted(probs: torch.Tensor, sigma: float) -> float:
    """Mean predicted flip probability per token over rows of probs [n, V] (the sampling distribution)."""
    p = probs.double()  # [n, V]
    return float((sigma * (1 - (p**2).sum(-1)) / math.sqrt(math.pi)).mean())


def noise_sigma(a: torch.Tensor, b: torch.Tensor, probs: torch.Tensor, mass: float = 0.999) -> float:
    """The rms of the logit differences a - b [n, V] (less each row's mean shift, which no sampler
    sees) over the tokens that carry the mass: the sigma of the model above."""
    d = (a.double() - b.double())  # [n, V]
    order = probs.argsort(dim=-1, descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(
        1, order, (probs.gather(1, order).cumsum(-1) - probs.gather(1, order)) < mass)  # [n, V]
    d = d - (d * keep).sum(-1, keepdim=True) / keep.sum(-1, keepdim=True)
    return float(((d**2) * keep).sum() / keep.sum()) ** 0.5


def measure(a: torch.Tensor, b: torch.Tensor, params: SamplingParams, *, seeds: int) -> tuple[int, int]:
    """(flips, draws): draws from logits rows a [n, V] and b [n, V] under the same `seeds` keys per row."""
    n = a.shape[0]
    flips = 0
    for s in range(seeds):
        sd = np.arange(n, dtype=np.int64) * 1_000_003 + s
        pos = np.arange(n, dtype=np.int64)
        ta, _ = draw(a, params, seeds=sd, positions=pos)
        tb, _ = draw(b, params, seeds=sd, positions=pos)
        flips += int((ta != tb).sum())
    return flips, n * seeds


def shape_logits(model, seqs: list[list[int]], starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced logits of the outputs of seqs (prompt + output; output from starts[i]) in two forward
    shapes: each sequence alone, and all of them in one right-padded batch. ([n, V], [n, V]) float32."""
    alone, batched = [], []
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)  # [B, L]
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.as_tensor(s)
        mask[i, : len(s)] = 1
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask).logits.float()  # [B, L, V]
        for i, (s, st) in enumerate(zip(seqs, starts)):
            # logits at position j predict token j + 1: the outputs are predicted from st - 1 to len - 2
            one = model(input_ids=torch.as_tensor([s])).logits[0].float()  # [L, V]
            alone.append(one[st - 1 : len(s) - 1])
            batched.append(out[i, st - 1 : len(s) - 1])
    return torch.cat(alone), torch.cat(batched)


def flip_row(model, seqs: list[list[int]], starts: list[int], params: SamplingParams, *, seeds: int = 16) -> dict:
    """Measured flips between two forward shapes (alone vs batched) on real logits, and the prediction of
    the noise model at the measured sigma."""
    a, b = shape_logits(model, seqs, starts)
    sigma = noise_sigma(a, b, torch.softmax(a.double(), -1))
    flips, draws = measure(a, b, params, seeds=seeds)
    return {"draws": draws, "flips": flips, "flip_rate": flips / draws, "sigma": sigma,
            "predicted_flip_rate": predicted(filtered_probs(a, params), sigma),
            "max_abs_logit_diff": float((a - b).abs().max())}
