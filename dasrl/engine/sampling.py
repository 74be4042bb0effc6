"""Sampling parameters and the position-keyed sampler.

The random number that request r uses at output position t is `uniform(seed_r, t)`: a counter-based
hash (two rounds of splitmix64) of the pair, never a stream advanced by the batch, the step or the
number of drafted tokens. A token is drawn by inverse CDF over the filtered, renormalised distribution,
summed in token-id order, so the draw is a pure function of (logits row, seed, position). That is what
makes speculative decoding exact here: verification samples the target token at each draft position
with the very number plain decoding would have used at that output position.

Filtering, in this order (as transformers' warpers): temperature, then top-k (keep every token whose
logit is >= the k-th largest, ties included), then top-p on the renormalised top-k distribution (keep
every token whose probability is >= the smallest probability of the shortest descending prefix whose
mass reaches top_p, ties included). Ties are kept whole so the kept set is a function of the values
alone, not of a sort's tie order. Greedy (temperature 0) takes the first argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
_STREAM = np.uint64(0xD1B54A32D192ED03)
_TOP_P_CANDIDATES = 256
"""top-p looks for its cut among this many largest probabilities first (a full sort only if needed)."""


@dataclass(frozen=True)
class SamplingParams:
    """How the target's distribution is turned into a token."""

    temperature: float = 0.0
    """0 = greedy (argmax); > 0 divides the logits."""
    top_k: int = 0
    """Keep the k most likely tokens (ties included); 0 = off."""
    top_p: float = 1.0
    """Nucleus: keep the smallest most-likely set whose mass reaches top_p; 1 = off. In (0, 1]."""

    def __post_init__(self) -> None:
        t, k, p = self.temperature, self.top_k, self.top_p
        if not isinstance(t, (int, float)) or not np.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {k!r}")
        if not isinstance(p, (int, float)) or not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _MUL1
    x = (x ^ (x >> np.uint64(27))) * _MUL2
    return x ^ (x >> np.uint64(31))


def uniforms(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """[n] float64 in [0, 1): the position-keyed uniform of each (seed, output position) pair."""
    s = np.asarray(seeds, dtype=np.int64).astype(np.uint64)  # two's complement: negative seeds are fine
    t = np.asarray(positions, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        h = _splitmix64(_splitmix64(s ^ _STREAM) ^ t)
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[n, V] float64: the sampling distribution of each row (zeros outside the kept set), normalised."""
    scores = logits.double() / params.temperature  # [n, V]
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scores, params.top_k, dim=-1).values[:, -1:]  # [n, 1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # [n, V]
    if params.top_p < 1.0:
        probs = _top_p(probs, params.top_p)
    return probs / probs.sum(dim=-1, keepdim=True)


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    n, vocab = probs.shape
    width = min(_TOP_P_CANDIDATES, vocab)
    top = torch.topk(probs, width, dim=-1).values  # [n, width], descending
    mass = top.cumsum(dim=-1)  # [n, width]
    reached = mass >= top_p  # [n, width]
    found = reached.any(dim=-1)  # [n]
    cut_idx = reached.int().argmax(dim=-1)  # [n]: first index reaching top_p
    cut = top.gather(1, cut_idx[:, None]).squeeze(1)  # [n]
    if not bool(found.all()):
        rows = torch.nonzero(~found).squeeze(1)
        full = torch.sort(probs[rows], dim=-1, descending=True).values  # [m, V]
        idx = (full.cumsum(dim=-1) >= top_p).int().argmax(dim=-1)  # [m]
        idx = torch.where((full.cumsum(dim=-1) >= top_p).any(dim=-1), idx, torch.full_like(idx, vocab - 1))
        cut[rows] = full.gather(1, idx[:, None]).squeeze(1)
    return probs.masked_fill(probs < cut[:, None], 0.0)


def sample(logits: torch.Tensor, params: SamplingParams, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Draw one token per row: ([n] int64 tokens, [n] float64 logprobs of them).

    logits [n, V]; u [n] the position-keyed uniforms. Logprobs are under the sampling distribution
    (after temperature, top-k, top-p); for greedy, under the model's own distribution (log-softmax of
    the raw logits), since the greedy distribution is a point mass.
    """
    if logits.shape[0] == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.float64)
    if params.greedy:
        tokens = torch.argmax(logits, dim=-1)  # [n], first maximum
        logp = torch.log_softmax(logits.double(), dim=-1).gather(1, tokens[:, None]).squeeze(1)
        return tokens.numpy().astype(np.int64), logp.numpy()
    probs = filtered_probs(logits, params)  # [n, V]
    cdf = probs.cumsum(dim=-1)  # [n, V] in token-id order
    target = torch.as_tensor(u, dtype=torch.float64)[:, None] * cdf[:, -1:]  # [n, 1]
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)  # [n]
    # searchsorted(right) lands on a token with positive mass; the clamp only guards u*total rounding.
    chosen = probs.gather(1, tokens[:, None]).squeeze(1)
    if bool((chosen == 0).any()):  # u * total rounded up to total: take the last token with mass
        bad = torch.nonzero(chosen == 0).squeeze(1)
        ids = torch.arange(probs.shape[1], dtype=torch.float64)
        tokens[bad] = ((probs[bad] > 0) * (ids + 1)).argmax(dim=-1)
        chosen = probs.gather(1, tokens[:, None]).squeeze(1)
    return tokens.numpy().astype(np.int64), torch.log(chosen).numpy()


def draw(logits: torch.Tensor, params: SamplingParams, *, seeds: np.ndarray,
         positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The engine's entry point: one token per row of logits [n, V] for request seeds [n] at output
    positions [n]; ([n] int64 tokens, [n] float64 logprobs). A pure function of (logits row, seed, position)."""
    return sample(logits, params, uniforms(seeds, positions))
