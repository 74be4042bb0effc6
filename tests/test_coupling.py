"""Coupled drafting (dasrl.engine.coupling): hand-worked trees, and the oracle — when the model's
distribution equals the draft's branch frequencies, the coupled chain is exactly what the sampler draws."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dasrl.drafter.base import ROOT, Draft, DraftBatch
from dasrl.engine.coupling import couple
from dasrl.engine.sampling import SamplingParams, draw

V = 1024  # four blocks of 256 token ids
GREEDY, T1 = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)


def tree(tokens, parents, probs) -> Draft:
    return Draft(np.array(tokens, np.int32), np.array(parents, np.int32), np.array(probs, np.float64), 3)


def chains(batch: DraftBatch) -> list[list[int]]:
    out = []
    for d in batch.drafts():
        assert d.is_chain
        out.append(d.tokens.tolist())
    return out


def test_greedy_follows_the_most_frequent_branch_ties_in_drafter_order():
    #        ctx
    #      /     \
    #   7 (.6)   9 (.4)
    #   /    \      \
    # 11(.3) 12(.3) 13(.4)
    t = tree([7, 9, 11, 12, 13], [ROOT, ROOT, 0, 0, 1], [0.6, 0.4, 0.3, 0.3, 0.4])
    out = couple(DraftBatch.from_drafts([t, Draft.empty()]), sampling=GREEDY, seeds=np.array([1, 2]),
                 positions=np.array([5, 0]))
    assert chains(out) == [[7, 11], []]
    assert out.probs.tolist() == [0.6, 0.3]  # the history's path probabilities of the kept nodes
    assert out.match_len.tolist() == [3, 0]


def test_chains_come_back_unchanged():
    b = DraftBatch.from_drafts([Draft.chain([4, 5, 6], [0.9, 0.8, 0.1]), Draft.chain([1])])
    assert couple(b, sampling=T1, seeds=np.array([0, 1]), positions=np.array([0, 9])) is b


def _logits(q: dict[int, float]) -> torch.Tensor:
    row = torch.full((1, V), -1e4)
    for tok, p in q.items():
        row[0, tok] = float(np.log(p))
    return row


@pytest.mark.parametrize("seed", range(300))
def test_oracle_two_levels_across_blocks(seed):
    # Level 1: tokens in blocks 0, 1 and 1; level 2 below each, distributions the model also has.
    level1 = {5: 0.5, 300: 0.3, 301: 0.2}
    level2 = {5: {700: 0.7, 20: 0.3}, 300: {21: 0.5, 22: 0.5}, 301: {900: 1.0}}
    tokens, parents, probs = [], [], []
    for a, pa in level1.items():
        tokens.append(a), parents.append(ROOT), probs.append(pa)
    for i, (a, pa) in enumerate(level1.items()):
        for b, pb in level2[a].items():
            tokens.append(b), parents.append(i), probs.append(pa * pb)
    pos = 40 + seed % 7
    out = chains(couple(DraftBatch.from_drafts([tree(tokens, parents, probs)]), sampling=T1,
                        seeds=np.array([seed]), positions=np.array([pos])))[0]
    first, _ = draw(_logits(level1), T1, seeds=np.array([seed]), positions=np.array([pos]))
    second, _ = draw(_logits(level2[int(first[0])]), T1, seeds=np.array([seed]), positions=np.array([pos + 1]))
    assert out == [int(first[0]), int(second[0])]


def test_rows_are_independent_and_keyed_by_their_own_seed_and_position():
    t = tree([5, 300, 301], [ROOT] * 3, [0.5, 0.3, 0.2])
    alone = [chains(couple(DraftBatch.from_drafts([t]), sampling=T1, seeds=np.array([s]), positions=np.array([p])))[0]
             for s, p in ((3, 10), (4, 11), (5, 12))]
    together = chains(couple(DraftBatch.from_drafts([t, t, t]), sampling=T1, seeds=np.array([3, 4, 5]),
                             positions=np.array([10, 11, 12])))
    assert together == alone
    picks = {chains(couple(DraftBatch.from_drafts([t]), sampling=T1, seeds=np.array([s]),
                           positions=np.array([0])))[0][0] for s in range(200)}
    assert picks == {5, 300, 301}  # not a fixed choice: the race picks each branch sometimes
