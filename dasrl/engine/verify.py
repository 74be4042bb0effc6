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


def _tree_path(tokens: np.ndarray, parents: np.ndarray, targets: np.ndarray) -> list[int]:
    """The accepted nodes of a tree (tokens [n], parents [n], ROOT = -1), root to tip, against the targets
    [n+1] at each input (pending, then each node): the first child equal to the target at its parent."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        p = int(p)
        if p != ROOT and not 0 <= p < i:
            raise ValueError(f"draft node {i} has parent {p}: parents must come before their children")
        children.setdefault(p, []).append(i)
    path, node = [], ROOT
    while True:
        want = int(targets[node + 1])  # the target sampled at the node's input (ROOT: the pending token's)
        node = next((c for c in children.get(node, []) if int(tokens[c]) == want), None)
        if node is None:
            return path
        path.append(node)


def _accept(drafts: DraftBatch, targets: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, dict[int, list[int]]]:
    """([B] accepted draft tokens per row, {tree row: its accepted path}): chains at once, trees walked."""
    n = drafts.lengths  # [B]
    row_of, local = drafts.node_rows()  # [T] each node's row and index within it
    # A chain node is accepted when it equals the target sampled at its parent (the input just before it).
    match = drafts.tokens == targets[starts[row_of] + local]  # [T]
    counts = n.astype(np.int64)  # [B] leading matches per row
    np.minimum.at(counts, row_of[~match], local[~match])
    paths = {}
    for b in np.unique(row_of[drafts.parents != local - 1]).tolist():  # rows whose draft is not a chain
        d = drafts.draft(b)
        paths[b] = _tree_path(d.tokens, d.parents, targets[starts[b]: starts[b + 1]])
        counts[b] = len(paths[b])
    return counts, paths


def accepted_counts(drafts: DraftBatch, targets: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """[B] accepted draft tokens of every row: the one accept rule (module docstring). Row b's targets are
    targets[starts[b]:starts[b+1]] (pending, then each node; a replay passes the recorded continuation at each
    input's depth, -1 past its end). Chains at once, trees walked row by row."""
    return _accept(drafts, targets, starts)[0]


def verify(draft: Draft, targets: np.ndarray) -> Verdict:
    """Verify a Draft (chain or tree) against its targets [len(draft)+1]."""
    if len(targets) != len(draft) + 1:
        raise ValueError(f"{len(draft)} draft tokens need {len(draft) + 1} targets, got {len(targets)}")
    return verify_batch(DraftBatch.from_drafts([draft]), np.asarray(targets), np.array([0, len(targets)]))[0]


def verify_batch(drafts: DraftBatch, targets: np.ndarray, starts: np.ndarray) -> list[Verdict]:
    """Every row's verdict (accepted_counts' rule; row b's targets are targets[starts[b]:starts[b+1]])."""
    counts, paths = _accept(drafts, targets, starts)  # [B], the tree rows' accepted paths
    lengths = drafts.lengths.tolist()
    out = []
    for b, a in enumerate(counts.tolist()):
        row_targets = np.asarray(targets[starts[b]: starts[b + 1]], dtype=np.int64)
        if b not in paths:  # a chain
            emit_at, bonus = np.arange(a + 1, dtype=np.int64), a == lengths[b]
        else:
            path = paths[b]
            emit_at = np.asarray([0] + [i + 1 for i in path], dtype=np.int64)
            bonus = not np.any(drafts.draft(b).parents == (path[-1] if path else ROOT))
        out.append(Verdict(emit_at, row_targets[emit_at], bonus=bonus))
    return out
