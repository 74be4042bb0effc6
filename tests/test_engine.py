"""SpecEngine on the real model: exactness (greedy, seeded sampling, batch independence), forward savings,
stops, logprobs, bad input and failed steps.

Exactness is checked token for token, fp32: speculative == the engine with drafting off == HF
`model.generate` (greedy), for every drafter that exists and several budgets, chain and tree: the whole
matrix on a tiny random Llama (the engine's code paths, at a fraction of a second a case), a few cases of
each kind on the real model.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from dasrl.drafter.base import Draft, DrafterBase, DraftParams, check_budgets  # noqa: E402
from dasrl.engine import EngineConfig, EngineStepError, SamplingParams, SpecEngine  # noqa: E402
from dasrl.engine.sampling import filtered_probs  # noqa: E402
from dasrl.policy.base import FixedBudget  # noqa: E402
from support.drafters import Oracle, PromptLookup  # noqa: E402

HAS_STORE = os.path.exists(os.path.join(os.path.dirname(__file__), "..", "dasrl", "drafter", "store.py"))
NEW = 24
BIG = 1000
THREADS = int(os.environ.get("DASRL_TEST_THREADS", "1"))
"""torch threads for the tests: 1 by default, since oversubscribed cores (a shared machine) make 2 threads
several times slower than 1; exactness does not depend on it."""
GREEDY = SamplingParams(temperature=0.0)
NUCLEUS = SamplingParams(temperature=0.6, top_p=0.95)
TOPK = SamplingParams(temperature=0.6, top_k=20)


# ---------------------------------------------------------------- fixtures
SEEDS = list(range(100, 110))


@pytest.fixture(scope="session")
def engine(smollm):
    model, tok = smollm
    return SpecEngine(model, tok, EngineConfig(num_threads=THREADS))


@pytest.fixture(scope="session")
def hf_greedy(smollm, chat_prompts):
    """HF model.generate, greedy, one prompt at a time."""
    model, _ = smollm
    out = []
    with torch.inference_mode():
        for p in chat_prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False,
                                 attention_mask=torch.ones(1, len(p), dtype=torch.long))
            out.append(ids[0, len(p):].tolist())
    return out


@pytest.fixture(scope="session")
def plain(engine, chat_prompts):
    """The engine with drafting off: {sampling name: completions}."""
    return {name: engine.generate(chat_prompts, sampling=params, seeds=SEEDS[: len(chat_prompts)], max_new_tokens=NEW)
            for name, params in [("greedy", GREEDY), ("nucleus", NUCLEUS), ("topk", TOPK)]}


@pytest.fixture(scope="session")
def history(engine, chat_prompts):
    """Earlier rollouts of the same prompts (an 'epoch 1'): sampled at T=0.8, two per prompt."""
    rolls = engine.generate(chat_prompts * 2, sampling=SamplingParams(temperature=0.8), seeds=range(2 * len(chat_prompts)),
                            max_new_tokens=NEW)
    return [(c.prompt_ids, c.token_ids) for c in rolls]


def perturb(tokens, every=5, vocab=49152):
    """A continuation that is right most of the time and wrong every `every` tokens."""
    return [(t + 1) % vocab if i % every == every - 1 else t for i, t in enumerate(tokens)]


class TreeOracle(DrafterBase):
    """Tree drafts whose first root child is always wrong and whose right path runs through second children,
    so the accepted path is never contiguous in the input (exercises the cache compaction)."""

    def __init__(self, futures, vocab=49152):
        self.future = {k: list(v) for k, v in futures.items()}
        self.vocab = vocab
        self.pos = {}
        self.trees = 0

    def start(self, req_id, problem_id, prompt_ids):
        self.pos[req_id] = 0

    def propose(self, req_ids, budgets):
        check_budgets(req_ids, budgets)
        out = []
        for r, b in zip(req_ids, budgets):
            fut = self.future[r][self.pos[r]:]
            toks, parents, parent = [], [], -1
            for t in fut:
                if len(toks) + 2 > b:
                    break
                toks += [(t + 7) % self.vocab, t]
                parents += [parent, parent]
                parent = len(toks) - 1
            if not toks and b >= 1 and fut:
                toks, parents = [fut[0]], [-1]  # budget 1: a plain one-token draft
            elif toks:
                self.trees += 1
            out.append(Draft(np.asarray(toks, np.int32), np.asarray(parents, np.int32), np.ones(len(toks))))
        return out

    def observe(self, req_id, tokens):
        self.pos[req_id] += len(tokens)

    def finish(self, req_id):
        del self.pos[req_id]

    def abort(self, req_id):
        del self.pos[req_id]

    def end_step(self):
        pass


def make_drafter(name, *, futures, history, vocab=49152):
    """A fresh drafter by name; futures = the true completions by request id (for the oracles); vocab: the
    model's (the wrong tokens stay in it)."""
    if name == "ngram":
        return PromptLookup()
    if name == "oracle":
        return Oracle(futures)
    if name == "wrong-oracle":
        return Oracle({k: perturb(v, vocab=vocab) for k, v in futures.items()})
    if name == "tree-oracle":
        return TreeOracle(futures, vocab)
    from dasrl.drafter.store import DraftStore, StoreConfig

    mode, branching = {"das": ("problem+request", 1), "problem": ("problem", 1), "global": ("global", 1),
                       "das-tree": ("problem+request", 3)}[name]
    store = DraftStore(StoreConfig(mode=mode, params=DraftParams(branching=branching)))
    for prompt, resp in history:
        store.add_rollout(None, prompt, resp)
    for i, (prompt, resp) in enumerate(history[: len(history) // 2]):
        store.add_rollout(None, prompt, perturb(resp, every=7, vocab=vocab))
    store.end_step()
    return store


STORE = ["das", "problem", "global", "das-tree"] if HAS_STORE else []
DRAFTERS = ["ngram", "oracle", "wrong-oracle", "tree-oracle"] + STORE
# Every drafter at a moderate budget; budgets 1 and "unlimited" (capped only by the room left) for the
# drafters where they exercise different paths (kept to a few so the suite stays fast).
GREEDY_CASES = [(d, 4) for d in DRAFTERS] + [(d, b) for d in ["oracle", "tree-oracle", "das"] if d in DRAFTERS
                                             for b in (1, BIG)] + [(d, BIG) for d in ["wrong-oracle", "das-tree"]
                                                                   if d in DRAFTERS]
SAMPLED_CASES = [("ngram", 4), ("oracle", BIG), ("wrong-oracle", 4)] + (
    [("das", 1), ("das", 4), ("das", BIG), ("das-tree", 4), ("das-tree", BIG)] if HAS_STORE else [("ngram", 1)])
TOPK_CASES = [("oracle", 4)] + ([("das", 4), ("das-tree", BIG)] if HAS_STORE else [("ngram", BIG)])
# On the real model, a few cases of each kind: chain drafts from the history store, tree drafts whose accepted
# path is not contiguous, rejected drafts; the whole matrix runs on the tiny model.
REAL = {"greedy": [("das" if HAS_STORE else "ngram", 4), ("tree-oracle", BIG), ("wrong-oracle", BIG)],
        "nucleus": [("das", BIG), ("das-tree", 4)] if HAS_STORE else [("oracle", BIG), ("wrong-oracle", 4)],
        "topk": [TOPK_CASES[1]]}


def cases(kind, matrix):
    return [pytest.param("smollm", n, b, id=f"smollm-{n}-{b}") for n, b in REAL[kind]] + [
        pytest.param("tiny", n, b, id=f"tiny-{n}-{b}") for n, b in matrix]


class Setup:
    """What a parametrized exactness case needs of one model: the engine, prompts, plain decoding, HF greedy
    and an earlier epoch's rollouts."""

    def __init__(self, engine, prompts, plain, hf_greedy, history, vocab):
        self.engine, self.prompts, self.plain = engine, prompts, plain
        self.hf_greedy, self.history, self.vocab = hf_greedy, history, vocab


@pytest.fixture(scope="module")
def tiny_setup(tiny_llama):
    """The tiny random Llama (vocab 97), its head scaled so that samples repeat themselves often enough for
    history and n-gram drafts to be accepted as well as rejected; 8 prompts of different lengths."""
    model = tiny_llama()
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
    engine = SpecEngine(model, None, EngineConfig(num_threads=THREADS))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 97, size=n).tolist() for n in (3, 5, 7, 9, 11, 13, 17, 23)]
    seeds = SEEDS[: len(prompts)]
    plain = {name: engine.generate(prompts, sampling=params, seeds=seeds, max_new_tokens=NEW)
             for name, params in [("greedy", GREEDY), ("nucleus", NUCLEUS), ("topk", TOPK)]}
    with torch.inference_mode():
        hf = [model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                             attention_mask=torch.ones(1, len(p), dtype=torch.long))[0, len(p):].tolist()
              for p in prompts]
    rolls = engine.generate(prompts * 2, sampling=SamplingParams(temperature=0.8), seeds=range(2 * len(prompts)),
                            max_new_tokens=NEW)
    assert tokens(plain["greedy"]) == hf
    return Setup(engine, prompts, plain, hf, [(c.prompt_ids, c.token_ids) for c in rolls], 97)


@pytest.fixture
def case(request):
    """The Setup of the model a case names: 'smollm' (the real model's session fixtures) or 'tiny'."""
    if request.param == "tiny":
        return request.getfixturevalue("tiny_setup")
    get = request.getfixturevalue
    return Setup(get("engine"), get("chat_prompts"), get("plain"), get("hf_greedy"), get("history"), 49152)


def tokens(completions):
    return [c.token_ids for c in completions]


# ---------------------------------------------------------------- greedy exactness
def test_plain_greedy_equals_hf_generate(plain, hf_greedy):
    assert tokens(plain["greedy"]) == hf_greedy


@pytest.mark.slow
@pytest.mark.parametrize("case, name, budget", cases("greedy", GREEDY_CASES), indirect=["case"])
def test_greedy_speculative_is_exact(case, name, budget):
    futures = dict(enumerate(case.hf_greedy))
    drafter = make_drafter(name, futures=futures, history=case.history, vocab=case.vocab)
    out = case.engine.generate(case.prompts, sampling=GREEDY, drafter=drafter, policy=FixedBudget(budget),
                               max_new_tokens=NEW, seeds=SEEDS[: len(case.prompts)])
    assert tokens(out) == case.hf_greedy
    assert [c.finish_reason for c in out] == [c.finish_reason for c in case.plain["greedy"]]
    drafted = sum(c.drafted for c in out)
    assert drafted > 0, "the drafter never drafted: the test would prove nothing"
    if name == "tree-oracle" and budget > 1:
        assert drafter.trees > 0 and sum(c.accepted for c in out) > 0
    if name in ("oracle", "tree-oracle"):
        assert sum(c.forwards for c in out) < sum(c.forwards for c in case.plain["greedy"])


# ---------------------------------------------------------------- sampled exactness
@pytest.mark.slow
@pytest.mark.parametrize("case, name, budget", cases("nucleus", SAMPLED_CASES), indirect=["case"])
def test_nucleus_speculative_is_exact(case, name, budget):
    ref = case.plain["nucleus"]
    drafter = make_drafter(name, futures={i: c.token_ids for i, c in enumerate(ref)}, history=case.history,
                           vocab=case.vocab)
    out = case.engine.generate(case.prompts, sampling=NUCLEUS, seeds=SEEDS[: len(case.prompts)], drafter=drafter,
                               policy=FixedBudget(budget), max_new_tokens=NEW)
    assert tokens(out) == tokens(ref)
    assert sum(c.drafted for c in out) > 0
    for a, b in zip(out, ref):
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-4)


@pytest.mark.parametrize("case, name, budget", cases("topk", TOPK_CASES), indirect=["case"])
def test_topk_speculative_is_exact(case, name, budget):
    ref = case.plain["topk"]
    drafter = make_drafter(name, futures={i: c.token_ids for i, c in enumerate(ref)}, history=case.history,
                           vocab=case.vocab)
    out = case.engine.generate(case.prompts, sampling=TOPK, seeds=SEEDS[: len(case.prompts)], drafter=drafter,
                               policy=FixedBudget(budget), max_new_tokens=NEW)
    assert tokens(out) == tokens(ref)


# ---------------------------------------------------------------- the same ladder on tiny random llama and qwen2
TINY_PROMPTS = [[5, 9, 14, 3, 77], [1, 2], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [88], [7, 7, 7, 7]]
V = 97
"""The tiny models' vocabulary (conftest's tiny_llama and tiny_qwen2)."""


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tiny_llama, tiny_qwen2):
    """(model, engine) for a small random model of each architecture the engine claims (issue 42: on every
    supported transformers release, each architecture's own attention and cache code paths)."""
    model = {"llama": tiny_llama, "qwen2": tiny_qwen2}[request.param]()
    return model, SpecEngine(model, config=EngineConfig(num_threads=THREADS))


def test_tiny_models_greedy_equals_hf_generate_and_speculation_is_exact(tiny):
    model, engine = tiny
    with torch.inference_mode():
        hf = [model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                             pad_token_id=0, attention_mask=torch.ones(1, len(p), dtype=torch.long))[0, len(p):].tolist()
              for p in TINY_PROMPTS]
    plain = engine.generate(TINY_PROMPTS, sampling=GREEDY, max_new_tokens=NEW, ignore_eos=True)
    assert tokens(plain) == hf
    futures = dict(enumerate(hf))
    history = [(p, perturb(h, every=4, vocab=V)) for p, h in zip(TINY_PROMPTS, hf)]
    for name, budget in [("ngram", 4), ("oracle", BIG), ("wrong-oracle", 4), ("tree-oracle", 5)] + \
            ([("das-tree", BIG)] if HAS_STORE else []):
        drafter = make_drafter(name, futures=futures, history=history, vocab=V)
        out = engine.generate(TINY_PROMPTS, sampling=GREEDY, drafter=drafter, policy=FixedBudget(budget),
                              max_new_tokens=NEW, ignore_eos=True)
        assert tokens(out) == hf, name
        assert sum(c.drafted for c in out) > 0, name


@pytest.mark.parametrize("sampling", [NUCLEUS, TOPK, SamplingParams(temperature=1.0)], ids=["nucleus", "topk", "T=1"])
def test_tiny_models_sampled_speculation_is_exact(tiny, sampling):
    _, engine = tiny
    seeds = list(range(7, 7 + len(TINY_PROMPTS)))
    ref = engine.generate(TINY_PROMPTS, sampling=sampling, seeds=seeds, max_new_tokens=NEW, ignore_eos=True)
    history = [(p, perturb(c.token_ids, every=4, vocab=V)) for p, c in zip(TINY_PROMPTS, ref)]
    for name, budget in [("oracle", BIG), ("wrong-oracle", 4)] + ([("das", 4)] if HAS_STORE else []):
        drafter = make_drafter(name, futures={i: c.token_ids for i, c in enumerate(ref)}, history=history, vocab=V)
        out = engine.generate(TINY_PROMPTS, sampling=sampling, seeds=seeds, drafter=drafter, policy=FixedBudget(budget),
                              max_new_tokens=NEW, ignore_eos=True)
        assert tokens(out) == tokens(ref), name
        assert sum(c.drafted for c in out) > 0, name
        for a, b in zip(out, ref):
            np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-4)


def test_sampling_differs_by_seed_and_from_greedy(plain, engine, chat_prompts):
    other = engine.generate(chat_prompts[:4], sampling=NUCLEUS, seeds=[1, 2, 3, 4], max_new_tokens=NEW)
    assert tokens(other) != tokens(plain["nucleus"][:4])
    assert tokens(plain["nucleus"]) != tokens(plain["greedy"])


@pytest.mark.slow
def test_batch_composition_does_not_matter(engine, chat_prompts, history):
    prompts = chat_prompts + chat_prompts  # 16 rows: each prompt twice, with other seeds
    seeds = list(range(500, 516))
    batch = engine.generate(prompts, sampling=NUCLEUS, seeds=seeds, max_new_tokens=NEW)
    assert len({tuple(t) for t in tokens(batch)}) > 8
    for i in (5, 12):
        alone = engine.generate([prompts[i]], sampling=NUCLEUS, seeds=[seeds[i]], max_new_tokens=NEW)
        assert alone[0].token_ids == batch[i].token_ids
        drafter = make_drafter("das" if HAS_STORE else "ngram", futures={}, history=history)
        spec = engine.generate([prompts[i]], sampling=NUCLEUS, seeds=[seeds[i]], drafter=drafter,
                               policy=FixedBudget(6), max_new_tokens=NEW)
        assert spec[0].token_ids == batch[i].token_ids


# ---------------------------------------------------------------- savings, stops, logprobs
@pytest.mark.parametrize("budget", [3, 7])
def test_oracle_saves_forwards(engine, chat_prompts, plain, budget):
    prompts = chat_prompts[:3]
    ref = engine.generate(prompts, sampling=GREEDY, ignore_eos=True, max_new_tokens=NEW)
    drafter = Oracle({i: c.token_ids for i, c in enumerate(ref)})
    out = engine.generate(prompts, sampling=GREEDY, ignore_eos=True, max_new_tokens=NEW, drafter=drafter,
                          policy=FixedBudget(budget))
    assert tokens(out) == tokens(ref)
    for c in out:  # the prefill emits token 0; every step then emits budget + 1
        assert c.forwards == 1 + math.ceil((NEW - 1) / (budget + 1))
        assert c.accepted == NEW - c.forwards
    assert all(c.forwards == NEW for c in ref)


def test_rows_leave_the_batch(engine, chat_prompts):
    steps = []
    out = engine.generate(chat_prompts, sampling=GREEDY, max_new_tokens=NEW, on_step=steps.append)
    sizes = [s.batch_size for s in steps]
    assert sizes[0] == len(chat_prompts) and sizes == sorted(sizes, reverse=True)
    assert sum(s.finished for s in steps) == len(chat_prompts)
    assert sum(s.new_tokens for s in steps) == sum(len(c.token_ids) for c in out)
    assert any(c.finish_reason == "stop" for c in out), "need a row that stops early"
    # a row that stopped early left the batch at once: later steps computed fewer rows
    first_stop = min(len(c.token_ids) for c in out if c.finish_reason == "stop")
    assert sizes[first_stop] < len(chat_prompts)
    assert [s.step for s in steps] == list(range(len(steps)))
    assert all(s.elapsed_s > 0 and s.verify_s > 0 for s in steps)


def test_stops(engine, smollm, chat_prompts, plain):
    _, tok = smollm
    ref = plain["greedy"]
    i = max(range(len(ref)), key=lambda j: len(ref[j].token_ids))
    full = ref[i].token_ids
    # a stop token id: ends right after its first occurrence
    stop_id = full[10]
    out = engine.generate([chat_prompts[i]], sampling=GREEDY, stop_token_ids=[stop_id], max_new_tokens=NEW)[0]
    assert out.token_ids == full[: full.index(stop_id) + 1] and out.finish_reason == "stop"
    # a stop string: ends at the token that completes it, speculative or not
    text = tok.decode(full)
    stop = text[len(tok.decode(full[:12])):][:6].strip() or text[-4:]
    for drafter in (None, Oracle({0: full})):
        got = engine.generate([chat_prompts[i]], sampling=GREEDY, stop_strings=[stop], max_new_tokens=NEW, drafter=drafter,
                              policy=FixedBudget(8))[0]
        assert got.finish_reason == "stop" and stop in tok.decode(got.token_ids)
        assert stop not in tok.decode(got.token_ids[:-1])
        assert got.token_ids == full[: len(got.token_ids)]
    # max_new_tokens and the context limit
    got = engine.generate([chat_prompts[i]], sampling=GREEDY, max_new_tokens=5)[0]
    assert got.token_ids == full[:5] and got.finish_reason == "length"
    small = SpecEngine(smollm[0], tok, EngineConfig(max_context=len(chat_prompts[i]) + 4, num_threads=THREADS))
    for drafter in (None, Oracle({0: full})):
        got = small.generate([chat_prompts[i]], sampling=GREEDY, max_new_tokens=NEW, drafter=drafter, policy=FixedBudget(16))[0]
        assert got.token_ids == full[:4] and got.finish_reason == "context"


def test_logprobs_match_a_full_forward(engine, smollm, chat_prompts, plain):
    model, _ = smollm
    for name, params in [("greedy", GREEDY), ("topk", TOPK), ("nucleus", NUCLEUS)]:
        c = plain[name][3]
        seq = torch.tensor([c.prompt_ids + c.token_ids])
        with torch.inference_mode():
            logits = model(seq).logits[0, len(c.prompt_ids) - 1 : -1]  # [n, V]
        if params.greedy:
            dist = torch.softmax(logits.double(), -1)
        else:
            dist = filtered_probs(logits, params)
        want = torch.log(dist[torch.arange(len(c.token_ids)), torch.tensor(c.token_ids)]).numpy()
        np.testing.assert_allclose(c.logprobs, want, rtol=0, atol=2e-3)
        assert len(c.logprobs) == len(c.token_ids)


# ---------------------------------------------------------------- bad input, failed steps
@pytest.mark.parametrize("kwargs, match", [
    ({"prompts": []}, "non-empty"),
    ({"prompts": [[1, 2], []]}, "prompt 1 is empty"),
    ({"prompts": [[1, 49152]]}, "49152"),
    ({"prompts": [[1, -3]]}, "-3"),
    ({"prompts": [[1] * 8192]}, "8192"),
    ({"prompts": [[1, 2]], "seeds": [1, 2]}, "2 seeds for 1 prompts"),
    ({"prompts": [[1, 2]], "max_new_tokens": 0}, "max_new_tokens"),
    ({"prompts": [[1, 2]], "stop_token_ids": [10**6]}, "1000000"),
    ({"prompts": ["hello"]}, "string"),
    ({"prompts": [[1, 2], [3]], "req_ids": ["a", "a"]}, "unique"),
])
def test_bad_input_is_refused_before_work(engine, kwargs, match):
    calls = []
    kwargs.setdefault("on_step", calls.append)
    with pytest.raises((ValueError, TypeError), match=match):
        engine.generate(**kwargs)
    assert calls == []


def test_bad_sampling_values():
    with pytest.raises(ValueError, match="1.5"):
        SamplingParams(temperature=0.5, top_p=1.5)
    with pytest.raises(ValueError, match="-1"):
        SamplingParams(temperature=-1)


class FailingDrafter(PromptLookup):
    def __init__(self, fail_at):
        super().__init__()
        self.calls, self.fail_at = 0, fail_at

    def propose(self, req_ids, budgets):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("drafter exploded")
        return super().propose(req_ids, budgets)


def test_failed_step_leaves_rows_consistent(engine, chat_prompts, plain):
    ref = tokens(plain["greedy"])
    drafter = FailingDrafter(fail_at=4)
    with pytest.raises(EngineStepError, match="drafter exploded") as info:
        engine.generate(chat_prompts, sampling=GREEDY, drafter=drafter, policy=FixedBudget(4), max_new_tokens=NEW)
    assert info.value.step == 4
    for c, want in zip(info.value.partial, ref):
        assert len(c.token_ids) >= 4 and c.token_ids == want[: len(c.token_ids)]
        assert len(c.logprobs) == len(c.token_ids)
        assert c.forwards == 4 or c.finish_reason is not None
    assert drafter._ctx == {}  # every started request was finished


def test_bad_drafts_are_refused(engine, chat_prompts):
    class Garbage(PromptLookup):
        def propose(self, req_ids, budgets):
            return [Draft.chain([10**6] * min(b, 2)) for b in budgets]

    with pytest.raises(EngineStepError, match="outside"):
        engine.generate(chat_prompts[:2], sampling=GREEDY, drafter=Garbage(), policy=FixedBudget(2), max_new_tokens=4)
