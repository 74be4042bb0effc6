"""EngineConfig(batch_invariant=True) on the real model (fp32, CPU): a request's logits, tokens and logprobs
do not depend on the other requests of the batch (how many, which, in what order), and the exactness
ladder (speculative == plain, greedy and seeded sampling) still holds with it on."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import dasrl.engine.engine as engine_module  # noqa: E402
from dasrl.engine.packing import _first_groups, _more_views  # noqa: E402
from dasrl.drafter import DraftStore  # noqa: E402
from dasrl.engine import EngineConfig, SamplingParams, SpecEngine  # noqa: E402
from dasrl.policy.base import FixedBudget  # noqa: E402
from dasrl.rollout import StepSummary  # noqa: E402
from support.drafters import Oracle  # noqa: E402

THREADS = int(os.environ.get("DASRL_TEST_THREADS", "1"))
NEW = 16
SAMPLING = SamplingParams(temperature=1.0, top_p=0.95)  # the default sampler: the gumbel race
SOLO = (0, 5, 11)
"""Requests also decoded alone (batch 1 is the slowest shape)."""


@pytest.fixture(scope="module")
def engine(smollm):
    model, tok = smollm
    return SpecEngine(model, tok, EngineConfig(num_threads=THREADS, batch_invariant=True))


@pytest.fixture(scope="module")
def requests(chat_prompts):
    """24 requests: the 8 chat prompts (8 different lengths) x 3 siblings, each with its own seed."""
    return [chat_prompts[i % 8] for i in range(24)], [700 + i for i in range(24)]


def decode(engine, monkeypatch, prompts, seeds, idx, *, keep=()):
    """Plain sampled decoding of requests idx in one batch: ({request: (tokens, logprobs)}, {(request,
    position): logits [V]} for the requests in keep), the logits as the sampler saw them."""
    real = engine_module.draw
    by_seed = {seeds[i]: i for i in idx}
    seen = {}

    def spy(logits, params, *, seeds, positions):  # logits [n, V]: every row the engine draws from
        for row, s, p in zip(logits, seeds.tolist(), positions.tolist()):
            if by_seed[s] in keep:
                seen[by_seed[s], p] = row.clone()
        return real(logits, params, seeds=seeds, positions=positions)

    monkeypatch.setattr(engine_module, "draw", spy)
    out = engine.generate([prompts[i] for i in idx], seeds=[seeds[i] for i in idx], sampling=SAMPLING,
                          max_new_tokens=NEW, ignore_eos=True)
    monkeypatch.undo()
    return {i: (c.token_ids, np.asarray(c.logprobs)) for i, c in zip(idx, out)}, seen


def test_a_request_decodes_the_same_in_any_batch(engine, requests, monkeypatch):
    prompts, seeds = requests
    perm = np.random.default_rng(1).permutation(24).tolist()
    shapes = {"24": [list(range(24))], "24 permuted": [perm], "8": [list(range(s, s + 8)) for s in (0, 8, 16)],
              "1": [[i] for i in SOLO]}
    outs, logits = {}, {}
    for name, batches in shapes.items():
        outs[name], logits[name] = {}, {}
        for idx in batches:
            o, seen = decode(engine, monkeypatch, prompts, seeds, idx, keep=SOLO)
            outs[name].update(o)
            logits[name].update(seen)
    ref = outs["24"]
    assert len({tuple(ref[i][0]) for i in range(24)}) > 20  # siblings really sampled apart
    for name, out in outs.items():
        for i, (toks, logps) in out.items():
            assert toks == ref[i][0], f"request {i}, batch {name}: tokens differ from the batch of 24"
            assert np.array_equal(logps, ref[i][1]), f"request {i}, batch {name}: logprobs differ"
    keys = logits["24"].keys()
    assert len(keys) == len(SOLO) * NEW
    for name, seen in logits.items():
        assert seen.keys() == keys
        for k in keys:
            assert torch.equal(seen[k], logits["24"][k]), f"request {k[0]} position {k[1]}, batch {name}: logits"


def test_shared_views_do_differ(smollm, requests, monkeypatch):
    """The check above can fail: without the mode a request's logits do depend on its batch."""
    model, tok = smollm
    plain = SpecEngine(model, tok, EngineConfig(num_threads=THREADS))
    prompts, seeds = requests
    _, alone = decode(plain, monkeypatch, prompts, seeds, [SOLO[1]], keep=SOLO[1:2])
    _, batch = decode(plain, monkeypatch, prompts, seeds, list(range(8)), keep=SOLO[1:2])
    assert alone.keys() == batch.keys() and len(alone) == NEW
    assert not all(torch.equal(alone[k], batch[k]) for k in alone)


def capture(monkeypatch):
    """Record the logits [V] the sampler sees, by (seed, output position), until monkeypatch.undo()."""
    real, seen = engine_module.draw, {}

    def spy(logits, params, *, seeds, positions):  # logits [n, V]
        for row, s, p in zip(logits, seeds.tolist(), positions.tolist()):
            seen[s, p] = row.clone()
        return real(logits, params, seeds=seeds, positions=positions)

    monkeypatch.setattr(engine_module, "draw", spy)
    return seen


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0), SAMPLING], ids=["greedy", "T=1 top-p 0.95"])
def test_speculative_equals_plain_with_it_on(engine, chat_prompts, sampling, monkeypatch):
    """Tokens for every drafter; and with chain drafts, the very logits plain decoding draws from (each draft
    token is attended as a first token at its slot would be), pending and draft positions alike."""
    seeds = list(range(300, 308))
    base = capture(monkeypatch)
    plain = engine.generate(chat_prompts, seeds=seeds, sampling=sampling, max_new_tokens=NEW)
    monkeypatch.undo()
    futures = {i: c.token_ids for i, c in enumerate(plain)}
    wrong = {i: [t if j % 4 != 3 else (t + 1) % 49152 for j, t in enumerate(f)] for i, f in futures.items()}
    for drafter in (DraftStore(), Oracle(wrong)):  # the library's own drafter; an oracle that is wrong at times
        seen = capture(monkeypatch)
        spec = engine.generate(chat_prompts, seeds=seeds, sampling=sampling, max_new_tokens=NEW, drafter=drafter,
                               policy=FixedBudget(4))
        monkeypatch.undo()
        assert [c.token_ids for c in spec] == [c.token_ids for c in plain], type(drafter).__name__
        run = StepSummary.of(engine.last_steps)
        assert run.drafted > 0, type(drafter).__name__  # it did draft: the check is not vacuous
        assert len(seen) >= len(base)  # draws also where a rejected draft token sat
        for key, logits in base.items():
            assert torch.equal(seen[key], logits), (type(drafter).__name__, key)
    assert run.drafted > run.accepted > 0  # the oracle's drafts: some rejected


def test_invariant_views_by_hand():
    """Views are each token's own slot + 1 rounded up to the bucket (here 4); rows grouped by view, read
    as a view (row0) where consecutive."""
    order, groups = _first_groups(np.array([3, 0, 5]), 4)  # views 4, 4, 8
    assert order.tolist() == [0, 1, 2] and groups == ((0, 2, 4, 0), (2, 3, 8, 2))
    order, groups = _first_groups(np.array([5, 0, 3]), 4)  # views 8, 4, 4
    assert order.tolist() == [1, 2, 0] and groups == ((0, 2, 4, 1), (2, 3, 8, 0))
    order, groups = _first_groups(np.array([3, 5, 0]), 4)  # views 4, 8, 4: rows 0 and 2 gathered
    assert order.tolist() == [0, 2, 1] and groups == ((0, 2, 4, -1), (2, 3, 8, 1))
    # extra tokens of a row with 2 cached: slots 3, 4, 5 (the first token sits at 2) -> views 4, 8, 8
    assert _more_views(np.array([2, 3]), np.array([3, 4]), 4) == (((0, 1, 4), (1, 3, 8)), ((0, 4, 8),))
