"""Verification of chain and tree drafts against the target's sampled tokens (docs/engine.md, as vLLM's
rejection sampler names them).

The target token at an input (the pending token, then draft node i at input 1 + i) is sampled with the
position-keyed randomness of its output position. Walking from the root, a draft node is *accepted* when it
equals the target at its parent; at the first position where no child matches, the target itself is emitted
(*recovered*); when the walk reaches a node with no children, the target there is a free *bonus*. A step emits
accepted + 1 tokens, exactly plain decoding's, for any draft. Tree nodes at depth d share output position
t0 + d + 1; among siblings with the same token the first is followed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dasrl.drafter.base import ROOT, Draft, DraftBatch


@dataclass(frozen=True)
class Verdict:
    """The outcome of verifying one row's draft."""

    emit_at: np.ndarray  # [a+1] int64: input whose target each emitted token is (0 = pending, 1+i = node i)
    tokens: np.ndarray  # [a+1] int64: a accepted draft tokens, then one recovered or bonus token
    bonus: bool  # the walk ended on a node with no children

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
    """The accepted nodes of a tree (tokens [n], parents [n]), root to tip, against the targets [n+1] at each
    input (pending, then each node): the first child equal to the target at its parent."""
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
    """[B] accepted draft tokens of every row, the one accept rule; row b's targets are
    targets[starts[b]:starts[b+1]] (pending, then each node; a replay passes the recorded continuation)."""
    return _accept(drafts, targets, starts)[0]


def verify(draft: Draft, targets: np.ndarray) -> Verdict:
    """Verify a Draft (chain or tree) against its targets [len(draft)+1]."""
    if len(targets) != len(draft) + 1:
        raise ValueError(f"{len(draft)} draft tokens need {len(draft) + 1} targets, got {len(targets)}")
    return verify_batch(DraftBatch.from_drafts([draft]), np.asarray(targets), np.array([0, len(targets)]))[0]


def verify_batch(drafts: DraftBatch, targets: np.ndarray, starts: np.ndarray) -> list[Verdict]:
    """Every row's verdict (accepted_counts' rule and targets)."""
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
