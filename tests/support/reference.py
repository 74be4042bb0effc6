"""A brute-force reference suffix drafter: obviously correct and slow. The oracle for the native index.

Semantics (the native index in src/core must agree draft for draft):

* match: the candidates are the MAX_OCCURRENCES newest positions (in the order tokens were indexed, add
  and append alike) that end with the context's last ORDER tokens, when max_match and the context are
  that long; m is the largest L <= max_match such that context[-L:] ends a candidate that is followed by
  at least one more token, and the occurrences are all such candidates. If there is none, the same with
  the newest positions that end with the context's last token, and L < ORDER. (Without the bound this
  is the longest match over the whole index; the bound keeps a looping request's proposals cheap.)
* draft: best-first expansion. A node's children are the distinct tokens that follow its occurrences,
  each weighted by the sum of the weights of the sequences it comes from, ranked by (weight desc,
  token asc); the top `branching` become candidates whose path probability is the parent's times
  w / W (W = the weight of all continued occurrences). The candidate with the highest path probability
  (ties: the one pushed first) becomes the next node, until `budget` nodes are taken or no candidate
  with probability >= min_prob is left, or MAX_DRAFT nodes whatever the budget. With branching = 1
  this is a chain of the most frequent continuation.
* several sources (a cursor's index plus its added sources, each matched on its own): every source drafts
  and the draft with the highest score wins, score = the sum of its path probabilities (its expected
  accepted length); a later source must beat the best so far by a relative SCORE_TIE, ties go to the
  earlier source (`best_of`).
* best continuation (the oracle of the native `best_continuation_batch`, the bound the lab measures drafters
  against): the longest common prefix of a target and the tokens after one of the match's occurrences
  (`best_continuation`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from dasrl.drafter import MAX_DRAFT, DraftParams

ORDER = 4
"""Length of the context tail that picks a match's candidates (the native index's 4-gram chains)."""
MAX_OCCURRENCES = 1024
"""Candidates of a match, newest first (the native index's kMaxOccurrences)."""
SCORE_TIE = 1e-9
"""A later source's draft wins only if its score exceeds the best by this relative margin (kScoreTie): two
sums of the same probabilities, added in another order, must not flip the choice."""


@dataclass
class ReferenceDraft:
    tokens: list[int]
    parents: list[int]
    probs: list[float]
    match_len: int


@dataclass
class ReferenceIndex:
    seqs: dict[int, list[int]] = field(default_factory=dict)
    weights: dict[int, float] = field(default_factory=dict)
    stamps: dict[int, list[int]] = field(default_factory=dict)
    """When each position was indexed (a counter over every add and append): newest = largest."""
    clock: int = 0

    def add(self, seq_id: int, tokens: Sequence[int], weight: float = 1.0) -> None:
        assert seq_id not in self.seqs
        self.seqs[seq_id], self.stamps[seq_id] = [], []
        self.weights[seq_id] = weight
        self.append(seq_id, tokens)

    def append(self, seq_id: int, tokens: Sequence[int]) -> None:
        self.seqs[seq_id].extend(tokens)
        self.stamps[seq_id].extend(range(self.clock, self.clock + len(tokens)))
        self.clock += len(tokens)

    def remove(self, seq_id: int) -> None:
        del self.seqs[seq_id]
        del self.weights[seq_id]
        del self.stamps[seq_id]

    def scale_weights(self, factor: float) -> None:
        for k in self.weights:
            self.weights[k] *= factor

    def match(self, context: Sequence[int], max_match: int) -> tuple[int, list[tuple[int, int]]]:
        """(m, occurrences as (seq_id, index of the last matched token), newest first)."""
        ctx = list(context)
        cap = min(max_match, len(ctx))
        for g, lim in ((ORDER, cap), (1, min(cap, ORDER - 1))):
            if lim < g:
                continue
            m, occ = 0, []
            for sid, end in self._candidates(ctx[-g:]):
                seq = self.seqs[sid]
                if end + 1 >= len(seq):  # no continuation
                    continue
                L = g
                while L < min(lim, end + 1) and seq[end - L] == ctx[-1 - L]:
                    L += 1
                if L > m:
                    m, occ = L, []
                if L == m:
                    occ.append((sid, end))
            if m:
                return m, occ
        return 0, []

    def _candidates(self, tail: list[int]) -> list[tuple[int, int]]:
        """The MAX_OCCURRENCES newest positions (seq_id, end) whose tokens end with `tail`."""
        g = len(tail)
        found = [(self.stamps[sid][end], sid, end) for sid, seq in self.seqs.items()
                 for end in range(g - 1, len(seq)) if seq[end - g + 1:end + 1] == tail]
        found.sort(reverse=True)
        return [(sid, end) for _, sid, end in found[:MAX_OCCURRENCES]]

    def _children(self, occ: list[tuple[int, int]]) -> tuple[list[tuple[int, float]], float]:
        weight_of: dict[int, float] = {}
        for sid, end in occ:
            seq = self.seqs[sid]
            if end + 1 < len(seq):
                weight_of[seq[end + 1]] = weight_of.get(seq[end + 1], 0.0) + self.weights[sid]
        total = sum(weight_of.values())
        ranked = sorted(weight_of.items(), key=lambda tw: (-tw[1], tw[0]))
        return ranked, total

    def best_continuation(self, context: Sequence[int], target: Sequence[int], max_match: int) -> int:
        """The longest prefix of `target` that follows an occurrence of the context's longest match."""
        _, occ = self.match(context, max_match)
        best = 0
        for sid, end in occ:
            cont = self.seqs[sid][end + 1:end + 1 + len(target)]
            j = 0
            while j < len(cont) and cont[j] == target[j]:
                j += 1
            best = max(best, j)
        return best

    def propose(self, context: Sequence[int], budget: int, params: DraftParams = DraftParams()) -> ReferenceDraft:
        m, occ = self.match(context, params.max_match)
        out = ReferenceDraft([], [], [], m)
        budget = min(budget, MAX_DRAFT)
        if budget <= 0 or not occ:
            return out
        frontier: list[tuple[float, int, int, int, list[tuple[int, int]]]] = []  # prob, order, parent, tok, occ
        pushed = 0

        def expand(node_occ: list[tuple[int, int]], parent: int, parent_prob: float) -> None:
            nonlocal pushed
            ranked, total = self._children(node_occ)
            for tok, w in ranked[: params.branching]:
                prob = parent_prob * (w / total)
                if prob < params.min_prob:
                    break
                child_occ = [(sid, end + 1) for sid, end in node_occ
                             if end + 1 < len(self.seqs[sid]) and self.seqs[sid][end + 1] == tok]
                frontier.append((prob, pushed, parent, tok, child_occ))
                pushed += 1

        expand(occ, -1, 1.0)
        while frontier and len(out.tokens) < budget:
            best = max(frontier, key=lambda c: (c[0], -c[1]))
            frontier.remove(best)
            prob, _, parent, tok, child_occ = best
            out.tokens.append(tok)
            out.parents.append(parent)
            out.probs.append(prob)
            if len(out.tokens) < budget:
                expand(child_occ, len(out.tokens) - 1, prob)
        return out


def best_of(drafts: Sequence[ReferenceDraft]) -> ReferenceDraft:
    """The draft of several sources that wins (see the module docstring): drafts[0] is the first source's."""
    best, score = drafts[0], sum(drafts[0].probs)
    for d in drafts[1:]:
        if d.probs and sum(d.probs) > score * (1.0 + SCORE_TIE):
            best, score = d, sum(d.probs)
    return best
