"""Sampling parameters and the position-keyed sampler (docs/sampling.md).

Every random number is a counter-based hash (splitmix64) of (request seed, output position[, index]), never a
stream advanced by the batch or the draft, so a draw is a pure function of (logits row, seed, position): what
makes speculative decoding exact here. Filtering (temperature, top-k, top-p, as transformers' warpers) defines
the kept set on the raw logit values alone (ties kept whole). The draw is an exponential race,
argmax_i (logit_i / T + Gumbel(seed, position, i)), run in two exact levels: blocks of 256 token ids race with
their total mass, then the winning block's tokens race among themselves (P(block) P(token | block) = p_token).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
_RACE = np.uint64(0x8CB92BA72F3D8DD7)  # race key of a (seed, position)
_BLOCK_STREAM = np.uint64(0xA24BAED4963EE407)
_TOKEN_STREAM = np.uint64(0x9FB21C651E98DF25)
_TOP_P_NATS = (8.0, 10.5)  # top-p looks for its cut among the tokens within this many nats of the best first
_BLOCK = 256  # token ids per block of the race: part of what a seed means
_MIN_TEMPERATURE = 1e-5  # vLLM's greedy threshold: below it the draw is argmax in all but ties
_LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")  # vLLM's names (its *_logits modes are not offered)


@dataclass(frozen=True)
class SamplingParams:
    """How the target's distribution is turned into a token; defaults as vLLM's. Per-request settings (seeds,
    max_new_tokens, stops) are generate() arguments."""

    temperature: float = 1.0
    """0 = greedy (argmax); > 0 divides the logits."""
    top_k: int = 0
    """Keep the k most likely tokens (ties included); 0 = off (vLLM's -1 is taken as 0)."""
    top_p: float = 1.0
    """Nucleus: keep the smallest most-likely set whose mass reaches top_p; 1 = off. In (0, 1]."""
    logprobs_mode: str = "processed_logprobs"
    """'processed_logprobs' (under the sampling distribution) or 'raw_logprobs' (log-softmax of the raw logits)."""

    def __post_init__(self) -> None:
        t, k, p = self.temperature, self.top_k, self.top_p
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not np.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if 0 < t < _MIN_TEMPERATURE:  # refused, not turned greedy: greedy logprobs mean another thing
            raise ValueError(f"temperature {t!r} is below {_MIN_TEMPERATURE} (numerically argmax, and 1/T "
                             f"overflows near 5e-324): use 0 for greedy decoding")
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < -1:
            raise ValueError(f"top_k must be an int >= 0 (0 or -1 = off), got {k!r}")
        if k == -1:  # vLLM's older spelling of "off"
            object.__setattr__(self, "top_k", 0)
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if self.logprobs_mode not in _LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(_LOGPROBS_MODES)}; got "
                             f"{self.logprobs_mode!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _MUL1
    x = (x ^ (x >> np.uint64(27))) * _MUL2
    return x ^ (x >> np.uint64(31))


def _key(seeds: np.ndarray, positions: np.ndarray, stream: np.uint64) -> np.ndarray:
    s = np.asarray(seeds, dtype=np.int64).astype(np.uint64)  # two's complement: negative seeds are fine
    t = np.asarray(positions, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        return _splitmix64(_splitmix64(s ^ stream) ^ t)


def _gumbel(keys: np.ndarray, index: np.ndarray, stream: np.uint64) -> np.ndarray:
    """[n, m] float64 standard Gumbel noise of index [n, m] (or [m]) under row keys [n]."""
    with np.errstate(over="ignore"):
        base = _splitmix64(keys ^ stream)[:, None]  # [n, 1]
        h = _splitmix64(base + np.asarray(index, dtype=np.int64).astype(np.uint64) * _GOLDEN)  # [n, m]
    u = ((h >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))  # (0, 1): logs stay finite
    return -np.log(-np.log(u))


def _token_noise(seeds: np.ndarray, positions: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
    """[n, m] float64: the Gumbel noise G(seed, position, token) of the in-block race, for tokens [n, m]."""
    return _gumbel(_key(seeds, positions, _RACE), token_ids, _TOKEN_STREAM)


@dataclass(frozen=True)
class _Kept:
    """A batch's filtered distribution: weights ∝ the sampling probabilities, and the kept set's bounds."""

    weights: torch.Tensor | None  # [n, V] float64 of float32 exp((logit - max) / T), 0 off the kept set; or None
    lmax: torch.Tensor  # [n, 1] the row's largest logit
    floor: torch.Tensor  # [n, 1] a token is kept iff its logit >= floor
    block_mass: torch.Tensor  # [n, ceil(V / BLOCK)] float64 of the float32 sums of weights per block
    total: torch.Tensor  # [n] float64 sum of the block masses (the same order in every batch)


def _block_sums(w: torch.Tensor) -> torch.Tensor:
    n, vocab = w.shape
    full = vocab // _BLOCK
    parts = [w[:, : full * _BLOCK].reshape(n, full, _BLOCK).sum(-1)] if full else []  # [n, full]
    if vocab % _BLOCK:
        parts.append(w[:, full * _BLOCK :].sum(-1, keepdim=True))  # [n, 1]
    return torch.cat(parts, dim=1).double()


def _kept(logits: torch.Tensor, params: SamplingParams, *, weights: bool = True) -> _Kept:
    """The filtered, tempered distribution of each row of logits [n, V] (temperature > 0)."""
    n, vocab = logits.shape
    blocks = _Blocks(logits) if params.top_p < 1.0 else None
    lmax = logits.amax(dim=-1, keepdim=True) if blocks is None else blocks.lmax  # [n, 1]
    floor = torch.full_like(lmax, float("-inf"))  # [n, 1]
    if 0 < params.top_k < vocab:
        floor = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]  # [n, 1]: ties at rank k kept
    w = logits.float() - lmax.float()  # [n, V] float32 (logit - max) * T: exact for logits within 2x of max
    if params.temperature != 1.0:
        w.div_(params.temperature)
    if 0 < params.top_k < vocab:
        w.masked_fill_(logits < floor, float("-inf"))
    w = w.exp_()  # [n, V] float32 weights (docs/sampling.md, "Precision")
    mass = _block_sums(w)  # [n, nb]
    if params.top_p < 1.0:
        bad = ~torch.isfinite(lmax[:, 0])  # [n] NaN or +inf: no distribution to cut (the cut would fail on an index)
        if bad.any():
            i = int(torch.nonzero(bad)[0, 0])
            raise ValueError(f"logits row {i} is not finite (largest logit {float(lmax[i, 0])}): top-p needs "
                             "finite logits")
        cut = _top_p_floor(blocks, w, mass.sum(-1), top_p=params.top_p, temperature=params.temperature)
        floor = torch.maximum(floor, cut)
        mass = blocks.kept_mass(w, floor)
        if weights:
            w = w.masked_fill_(logits < floor, 0.0)
    return _Kept(weights=w.double() if weights else None, lmax=lmax, floor=floor, block_mass=mass,
                total=mass.sum(-1))


def _top_p_floor(blocks: "_Blocks", w: torch.Tensor, total: torch.Tensor, *, top_p: float,
                 temperature: float) -> torch.Tensor:
    """[n, 1] the logit of the last token of the shortest descending prefix whose mass reaches top_p. Only
    candidates are sorted: the tokens within _TOP_P_NATS of the best, then those with weight >= (1 - top_p)
    total / V (a sure superset of the nucleus)."""
    logits, lmax = blocks.logits, blocks.lmax
    n, vocab = logits.shape
    cut = torch.empty(n, 1, dtype=logits.dtype, device=logits.device)  # [n, 1]
    rows = torch.arange(n, device=logits.device)
    sure = ((1.0 - top_p) * total / vocab)[:, None]  # [n, 1]
    for stage in range(len(_TOP_P_NATS) + 2):
        last = stage == len(_TOP_P_NATS) + 1  # rounding left the sure candidates a hair short: keep them all
        if stage < len(_TOP_P_NATS):
            r, col = blocks.at_least(rows, lmax[rows] - _TOP_P_NATS[stage] * temperature)
        else:
            r, col = torch.nonzero(w[rows] >= sure[rows], as_tuple=True)  # [N] rows relative to `rows`
        at = rows[r]
        c, ok = _cut_among(logits[at, col], w[at, col].double() / total[at], r, len(rows), 2.0 if last else top_p)
        if last:
            cut[rows] = c
            break
        cut[rows[ok]] = c[ok]
        rows = rows[~ok]
        if len(rows) == 0:
            break
    return cut


class _Blocks:
    """The logits [n, V] by blocks of token ids, for top-p: only blocks whose largest logit reaches a row's
    threshold are touched."""

    def __init__(self, logits: torch.Tensor) -> None:
        n, vocab = logits.shape
        self.logits, self.full = logits, vocab // _BLOCK
        self.lb = logits[:, : self.full * _BLOCK].reshape(n * self.full, _BLOCK)  # [n * full, BLOCK]
        self.bmax = self.lb.amax(dim=-1).view(n, self.full)  # [n, full]
        self.lmax = logits.amax(dim=-1, keepdim=True) if vocab % _BLOCK or not self.full else \
            self.bmax.amax(dim=-1, keepdim=True)  # [n, 1] the row's largest logit

    def kept_mass(self, w: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
        """[n, nb] float64 block sums of the weights w [n, V] on the kept set (logits >= floor [n, 1]), bit for
        bit _block_sums of the masked weights (the same 256 values reduced the same way)."""
        n, vocab = w.shape
        full = self.full
        mass = torch.zeros(n, -(-vocab // _BLOCK), dtype=torch.float64, device=w.device)  # [n, nb]
        if full:
            r, b = torch.nonzero(self.bmax >= floor, as_tuple=True)  # [K] blocks holding a kept token
            flat = r * full + b  # [K]
            wb = w[:, : full * _BLOCK].reshape(n * full, _BLOCK).index_select(0, flat)  # [K, BLOCK]
            mass[r, b] = wb.masked_fill_(self.lb.index_select(0, flat) < floor[r], 0.0).sum(-1).double()
        if vocab % _BLOCK:
            tail = w[:, full * _BLOCK :].masked_fill(self.logits[:, full * _BLOCK :] < floor, 0.0)  # [n, V % BLOCK]
            mass[:, full] = tail.sum(-1).double()
        return mass

    def at_least(self, rows: torch.Tensor, thr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(r, col) [N] of the tokens of rows [m] with logit >= thr [m, 1]; r indexes `rows`."""
        whole = len(rows) == len(self.bmax)
        kr, b = torch.nonzero((self.bmax if whole else self.bmax[rows]) >= thr, as_tuple=True)  # [K] blocks
        sub = self.lb.index_select(0, rows[kr] * self.full + b)  # [K, BLOCK]
        k, j = torch.nonzero(sub >= thr[kr], as_tuple=True)  # [N] within [K, BLOCK]
        r, col = kr[k], b[k] * _BLOCK + j
        if self.logits.shape[1] % _BLOCK:  # the short last block
            tr, tj = torch.nonzero(self.logits[rows, self.full * _BLOCK :] >= thr, as_tuple=True)
            r, col = torch.cat([r, tr]), torch.cat([col, tj + self.full * _BLOCK])
        return r, col


def _ordered_bits(x: torch.Tensor) -> torch.Tensor:
    """[N] int64 in [0, 2^32) ordered as the float32 values x [N] (equal floats, equal keys; -0 < +0)."""
    bits = x.float().view(torch.int32).long() & 0xFFFFFFFF  # the raw bits, unsigned
    return torch.where(bits >= 1 << 31, 0xFFFFFFFF - bits, bits + (1 << 31))


def _cut_among(lv: torch.Tensor, mv: torch.Tensor, r: torch.Tensor, m: int,
               top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p cut of m rows among candidates: logits lv [N], masses mv [N], rows r [N]. Returns the [m, 1] cut
    logit (where not reached: the smallest candidate's) and [m] reached."""
    order = torch.argsort((r << 32) - _ordered_bits(lv))  # by row, each row by descending logit
    r, lv, mv = r[order], lv[order], mv[order]
    counts = torch.bincount(r, minlength=m)  # [m]
    at = torch.arange(len(r), device=lv.device) - (counts.cumsum(0) - counts)[r]  # rank within the row
    width = int(counts.max())
    # No cumulative sum across rows: each row's masses depend on that row alone.
    mass = torch.zeros(m, width, dtype=mv.dtype, device=lv.device)  # [m, width]
    mass[r, at] = mv
    cand = torch.full((m, width), float("inf"), dtype=lv.dtype, device=lv.device)  # [m, width]
    cand[r, at] = lv
    reached = mass.cumsum(dim=-1) >= top_p  # [m, width]
    ok = reached.any(dim=-1)  # [m]
    idx = torch.where(ok, reached.int().argmax(dim=-1), counts - 1)  # [m]
    return cand.gather(1, idx[:, None]), ok


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[n, V] float64: the sampling distribution of each row (zeros outside the kept set), normalised."""
    w = _kept(logits, params).weights
    return w / w.sum(dim=-1, keepdim=True)


def _race(logits: torch.Tensor, k: _Kept, params: SamplingParams, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The two-level race over the kept set; only blocks with mass and kept tokens get noise (the others never
    win), so each row's first maximum is _race_dense's, with the same noise."""
    n, vocab = logits.shape
    mass = k.block_mass.cpu().numpy()  # [n, nb]
    r, b = np.nonzero(mass > 0)  # [K] row-major
    with np.errstate(divide="ignore"):
        score = np.log(mass[r, b]) + _gumbel(keys[r], b[:, None], _BLOCK_STREAM)[:, 0]  # [K]
    win = _first_max(score, r, n)
    if win is None:
        return _race_dense(logits, k, params, keys)
    cols = b[win][:, None] * _BLOCK + np.arange(_BLOCK)[None, :]  # [n, BLOCK] token ids of the winning block
    idx = torch.as_tensor(np.minimum(cols, vocab - 1), device=logits.device)
    l = logits.gather(1, idx).double().cpu().numpy()  # [n, BLOCK]
    # The float64 scores the weights were made from, (logit - max) / T, on the kept set.
    r, j = np.nonzero((l >= k.floor.double().cpu().numpy()) & (l > -np.inf) & (cols < vocab))  # [N] row-major
    s = l[r, j] - k.lmax.double().cpu().numpy()[r, 0]  # [N]
    if params.temperature != 1.0:
        s /= params.temperature
    win = _first_max(s + _gumbel(keys[r], cols[r, j][:, None], _TOKEN_STREAM)[:, 0], r, n)
    if win is None:
        return _race_dense(logits, k, params, keys)
    return cols[r[win], j[win]].astype(np.int64), s[win] - np.log(k.total.cpu().numpy())


def _first_max(score: np.ndarray, r: np.ndarray, n: int) -> np.ndarray | None:
    """[n] the index of each row's first maximum of score [K] (rows r [K] sorted); None when a row has no
    entry or a score is not finite."""
    starts = np.searchsorted(r, np.arange(n))  # [n]
    if len(r) == 0 or (r[np.minimum(starts, len(r) - 1)] != np.arange(n)).any() or not np.isfinite(score).all():
        return None
    best = np.maximum.reduceat(score, starts)  # [n]
    hit = np.flatnonzero(score == best[r])  # [H] every maximum, row-major
    return hit[np.searchsorted(r[hit], np.arange(n))]


def _race_dense(logits: torch.Tensor, k: _Kept, params: SamplingParams,
                keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The race over every block and every token of the winning block (non-finite logits only)."""
    n, vocab = logits.shape
    mass = k.block_mass.cpu().numpy()  # [n, nb]
    nb = mass.shape[1]
    with np.errstate(divide="ignore"):
        blk = (np.log(mass) + _gumbel(keys, np.arange(nb), _BLOCK_STREAM)).argmax(axis=1)  # [n] first max
    cols = blk[:, None] * _BLOCK + np.arange(_BLOCK)[None, :]  # [n, BLOCK] token ids of the winning block
    inside = cols < vocab
    idx = torch.as_tensor(np.minimum(cols, vocab - 1), device=logits.device)
    l = logits.gather(1, idx)  # [n, BLOCK]
    s = l.double().sub_(k.lmax.double())
    if params.temperature != 1.0:
        s.div_(params.temperature)
    s = s.masked_fill_(l < k.floor, float("-inf")).cpu().numpy()  # [n, BLOCK]
    s[~inside] = -np.inf
    j = (s + _gumbel(keys, cols, _TOKEN_STREAM)).argmax(axis=1)  # [n]: ties go to the lowest token id
    rows = np.arange(n)
    logp = s[rows, j] - np.log(k.total.cpu().numpy())
    return cols[rows, j].astype(np.int64), logp


def draw(logits: torch.Tensor, params: SamplingParams, *, seeds: np.ndarray,
         positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One token per row of logits [n, V] for seeds [n] at output positions [n]: ([n] int64 tokens, [n] float64
    logprobs as params.logprobs_mode says; greedy: the log-softmax of the raw logits)."""
    n = logits.shape[0]
    if len(seeds) != n or len(positions) != n:
        raise ValueError(f"{n} logits rows but {len(seeds)} seeds and {len(positions)} positions")
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.float64)
    if params.greedy:
        tokens = torch.argmax(logits, dim=-1)  # [n], first maximum
        logp = torch.log_softmax(logits.double(), dim=-1).gather(1, tokens[:, None]).squeeze(1)
        return tokens.cpu().numpy().astype(np.int64), logp.cpu().numpy()
    k = _kept(logits, params, weights=False)  # the race reads only the block masses
    tokens, logp = _race(logits, k, params, _key(seeds, positions, _RACE))
    if params.logprobs_mode == "raw_logprobs":
        at = torch.as_tensor(tokens, device=logits.device)[:, None]
        logp = torch.log_softmax(logits.double(), dim=-1).gather(1, at).squeeze(1).cpu().numpy()
    return tokens, logp
