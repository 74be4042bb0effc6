"""Verification of chain and tree drafts against the target's sampled tokens.

Glossary (as in vLLM's rejection sampler):

- **target token** at an input position: the token the target model samples there with the
  position-keyed uniform of (seed, output position). Input position 0 is the row's *pending* token (the
  last emitted token, not yet in the KV cache); input position 1 + i is draft node i.
- **accepted** tokens: draft tokens equal to the target token sampled at their parent's position. Walking
  from the root, each accepted node extends the output by its token.
- **recovered** token: at the first position where no child matches (a rejection), the target token
  itself is emitted instead of the draft. One per step at most; it is exactly what plain decoding would
  have emitted there.
- **bonus** token: when the walk reaches a node with no children (the whole chain, or a tree leaf, was
  accepted; or the draft was empty), the target token sampled at that node is emitted for free.

A step therefore emits `accepted + 1` tokens: the accepted draft tokens, then one recovered or bonus
token. Because target tokens are sampled with the uniforms plain decoding would use at the same output
positions, the emitted tokens are exactly plain decoding's, for any draft.

For a tree, the node at depth d (the root's children have depth 0) sits at output position t0 + d + 1,
where t0 is the output position of the pending token's target; all nodes at the same depth share that
position's uniform. If siblings carry the same token, the first one (lowest index) is followed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dasrl.drafter.base import ROOT, Draft, DraftBatch


@dataclass(frozen=True)
class Verdict:
    """The outcome of verifying one row's draft."""

    emit_at: np.ndarray
    """[a+1] int64: input index whose target token becomes each emitted token (0 = pending, 1+i = node i)."""
    tokens: np.ndarray
    """[a+1] int64: the emitted tokens: a accepted draft tokens, then one recovered or bonus token."""
    bonus: bool
    """Whether the last emitted token is a bonus (the walk ended on a node with no children)."""

    @property
    def accepted(self) -> int:
        return len(self.tokens) - 1

    @property
    def path(self) -> np.ndarray:
        """[a] int64: the accepted draft nodes, root to tip."""
        return self.emit_at[1:] - 1


def depths(parents: np.ndarray) -> np.ndarray:
    """[n] int64: depth of each node (children of the root have depth 0); parents in topological order."""
    out = np.zeros(len(parents), dtype=np.int64)
    for i, p in enumerate(parents):
        if p != ROOT:
            if not 0 <= p < i:
                raise ValueError(f"draft node {i} has parent {p}: parents must come before their children")
            out[i] = out[p] + 1
    return out


def verify_chain(draft_tokens: np.ndarray, targets: np.ndarray) -> Verdict:
    """Chain draft [n] against targets [n+1] (target at the pending token, then at each draft token)."""
    n = len(draft_tokens)
    if len(targets) != n + 1:
        raise ValueError(f"{n} draft tokens need {n + 1} targets, got {len(targets)}")
    mismatch = np.flatnonzero(np.asarray(draft_tokens) != np.asarray(targets[:n]))
    a = int(mismatch[0]) if mismatch.size else n
    emit_at = np.arange(a + 1, dtype=np.int64)
    return Verdict(emit_at, np.asarray(targets, dtype=np.int64)[emit_at], bonus=a == n)


def verify_tree(draft_tokens: np.ndarray, parents: np.ndarray, targets: np.ndarray) -> Verdict:
    """Tree draft (tokens [n], parents [n], ROOT = -1) against targets [n+1] (pending, then each node)."""
    n = len(draft_tokens)
    if len(targets) != n + 1 or len(parents) != n:
        raise ValueError(f"{n} draft tokens need {n} parents and {n + 1} targets, "
                         f"got {len(parents)} and {len(targets)}")
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        p = int(p)
        if p != ROOT and not 0 <= p < i:
            raise ValueError(f"draft node {i} has parent {p}: parents must come before their children")
        children.setdefault(p, []).append(i)
    emit_at, node = [0], ROOT
    while True:
        want = int(targets[emit_at[-1]])
        kids = children.get(node, [])
        nxt = next((c for c in kids if int(draft_tokens[c]) == want), None)
        if nxt is None:
            idx = np.asarray(emit_at, dtype=np.int64)
            return Verdict(idx, np.asarray(targets, dtype=np.int64)[idx], bonus=not kids)
        emit_at.append(nxt + 1)
        node = nxt


def verify(draft: Draft, targets: np.ndarray) -> Verdict:
    """Verify a Draft (chain or tree) against its targets [len(draft)+1]."""
    if draft.is_chain:
        return verify_chain(draft.tokens, targets)
    return verify_tree(draft.tokens, draft.parents, targets)


def verify_batch(drafts: DraftBatch, targets: np.ndarray, starts: np.ndarray) -> list[Verdict]:
    """Every row's verdict: row b's targets are targets[starts[b]:starts[b+1]] (pending, then each node).
    Chains are verified for the whole batch at once; trees row by row."""
    n = drafts.lengths  # [B]
    batch = len(n)
    row_of = np.repeat(np.arange(batch), n)  # [T] row of each draft node
    local = np.arange(len(drafts.tokens)) - drafts.offsets[row_of]  # [T] node index within its row
    tree = np.zeros(batch, bool)
    tree[row_of[drafts.parents != local - 1]] = True  # [B] rows whose draft is not a chain
    # A chain node is accepted when it equals the target sampled at its parent (the input just before it).
    match = drafts.tokens == targets[starts[row_of] + local]  # [T]
    accepted = n.copy()  # [B] leading matches per row
    np.minimum.at(accepted, row_of[~match], local[~match])
    out = []
    for b in range(batch):
        row_targets = targets[starts[b] : starts[b + 1]]
        if tree[b]:
            d = drafts.draft(b)
            out.append(verify_tree(d.tokens, d.parents, row_targets))
            continue
        a = int(accepted[b])
        emit_at = np.arange(a + 1, dtype=np.int64)
        out.append(Verdict(emit_at, np.asarray(row_targets[: a + 1], dtype=np.int64), bonus=a == int(n[b])))
    return out
