"""Coupled drafting: a tree draft turned into the one chain the sampler itself would pick.

The engine's sampler is a position-keyed race (sampling.py): at output position t, request r emits
``argmax_i (log p_i + G(seed_r, t, i))`` (over blocks of token ids, then tokens), with the Gumbel noise G
a pure function of (seed, position, token) — known before the forward runs. A history drafter knows, at
each node of its tree, how often each continuation followed (the branch frequencies q). Running the
same race on q with the same noise picks the branch the target will sample whenever the model's
distribution there is close to the history's: for two distributions at total-variation distance d,
the two races agree with probability >= (1 - d) / (1 + d), against max_i q_i for "always the most
frequent branch". So one chain of the tree's tokens gets most of what verifying the whole tree would
accept, at the cost of a chain: on a CPU, where every drafted token costs compute, that is the point.

Lossless by construction: only the proposal changes; verification samples the target exactly as before.
Greedy sampling (T = 0) keeps the most frequent branch (ties: the drafter's order).
"""

from __future__ import annotations

import numpy as np

from dasrl.drafter.base import DraftBatch
from dasrl.engine.sampling import BLOCK, SamplingParams, _BLOCK_STREAM, _RACE, _TOKEN_STREAM, _gumbel, _key


def couple(drafts: DraftBatch, *, sampling: SamplingParams, seeds: np.ndarray, positions: np.ndarray) -> DraftBatch:
    """Each row's tree [offsets[b], offsets[b+1]) as the chain the race picks. `seeds` [B] are the rows'
    sampling seeds, `positions` [B] the output position of each row's first draft token (its output
    length: the pending token is position - 1). Chains come back as they are."""
    n, total = len(drafts), len(drafts.tokens)
    if total == 0 or _chains(drafts):
        return drafts
    lens = drafts.lengths  # [B]
    row = np.repeat(np.arange(n), lens)  # [T] each node's row
    par = drafts.parents.astype(np.int64)  # [T] row-local parent (-1: the context)
    gpar = np.where(par < 0, total + row, drafts.offsets[row] + par)  # [T] global parent; roots: total + row
    depth = _depth(par, drafts.offsets[row])  # [T] 1 for a child of the context
    parent_prob = np.where(par < 0, 1.0, drafts.probs[np.minimum(gpar, total - 1)])  # [T]
    q = drafts.probs / np.where(parent_prob > 0, parent_prob, 1.0)  # [T] branch frequency at its parent
    order = np.arange(total)
    if sampling.greedy:
        rank = np.lexsort((order, -q, gpar))  # per parent: most frequent first, then the drafter's order
    else:
        keys = _key(seeds[row], positions[row] + depth - 1, _RACE)  # [T] the race key of each node's position
        tok = drafts.tokens.astype(np.int64)
        block = tok // BLOCK
        group = np.unique(gpar * (1 + int(block.max())) + block, return_inverse=True)[1]  # [T] (parent, block)
        with np.errstate(divide="ignore"):
            block_score = np.log(np.bincount(group, weights=q)[group]) + _gumbel(keys, block[:, None], _BLOCK_STREAM)[:, 0]
            token_score = np.log(q) + _gumbel(keys, tok[:, None], _TOKEN_STREAM)[:, 0]
        rank = np.lexsort((order, -token_score, -block_score, gpar))  # per parent: the race's winner first
    first = np.ones(total, bool)
    first[1:] = gpar[rank[1:]] != gpar[rank[:-1]]
    choice = np.full(total + n, -1, np.int64)  # [T + B] the chosen child of each node and each row's context
    choice[gpar[rank[first]]] = rank[first]
    chain, cur = [], choice[total + np.arange(n)]  # [B] current node per row (-1: the chain ended)
    while (cur >= 0).any():
        chain.append(cur)
        cur = np.where(cur >= 0, choice[np.maximum(cur, 0)], -1)
    nodes = np.stack(chain, axis=1)  # [B, depth]
    keep = nodes >= 0
    new_lens = keep.sum(axis=1)
    picked = nodes[keep]  # row-major: each row's chain in order
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(new_lens, out=offsets[1:])
    parents = (np.arange(len(picked)) - np.repeat(offsets[:-1], new_lens) - 1).astype(np.int32)
    return DraftBatch(drafts.tokens[picked], parents, drafts.probs[picked], offsets, drafts.match_len)


def _chains(drafts: DraftBatch) -> bool:
    """Every row's draft is a chain (each node's parent the node before it)."""
    local = np.arange(len(drafts.tokens)) - np.repeat(drafts.offsets[:-1], drafts.lengths)
    return bool(np.array_equal(drafts.parents, local - 1))


def _depth(parents: np.ndarray, base: np.ndarray) -> np.ndarray:
    """[T] depth of each node (1 = a child of the context) from row-local parents in topological order."""
    depth = np.ones(len(parents), np.int64)
    has = parents >= 0
    glob = base + np.maximum(parents, 0)
    while True:  # one round per tree level
        new = np.where(has, depth[glob] + 1, 1)
        if np.array_equal(new, depth):
            return depth
        depth = new
