"""Counting drafts (dasrl/drafter/counting.py): hand-worked token arrays, a property test against rendered
patterns, the wrapper's protocol, and exactness on the real model (a counting prompt, greedy and seeded)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dasrl.drafter.counting import _NUM, CountingDrafter, _counting_draft, _items, _periods, digit_tokens
from support.drafters import PromptLookup

# A toy vocabulary: one token per character, digits d -> 10 + d.
DIGITS = np.arange(10, 20)
CHARS = {",": 1, " ": 2, "x": 3, "=": 4, "\n": 5, "#": 6, "a": 7, "b": 8, ":": 9}
DECODE = {v: k for k, v in CHARS.items()} | {10 + d: str(d) for d in range(10)}


def enc(text: str) -> np.ndarray:
    return np.array([10 + int(c) if c.isdigit() else CHARS[c] for c in text], np.int64)


def dec(tokens) -> str:
    return "".join(DECODE[int(t)] for t in tokens)


def draft(text: str, budget: int = 12) -> str:
    return dec(_counting_draft(enc(text), digits=DIGITS, budget=budget))


# ------------------------------------------------------------------ hand-worked
@pytest.mark.parametrize("text, expected", [
    ("a: 43, 44, 45, ", "46, 47, 48, "),             # a list: +1 per period
    ("a: 43, 44, 45, 4", "6, 47, 48, 4"),            # the tail ends inside a number: its other digits
    ("98\n99\n100\n101\n", "102\n103\n104\n"),       # more digits
    ("a: 07 08 09 ", "10 11 12 13 "),                  # zero padded to the width seen
    ("a: 3, 6, 9, ", "12, 15, 18, "),                  # +3
    ("5, 4, 3, 2, ", "1, 0, "),                      # counting down stops before -1
    ("3x12=36,3x13=93,3x14=223,3x1", "5="),          # the product is no progression: the draft stops there
    ("#1\na1b\n#2\na2b\n#3\na3b\n#", "4\na4b\n#5\na5b"),  # two slots per period
])
def test_hand_worked(text, expected):
    assert draft(text) == expected


@pytest.mark.parametrize("text", [
    "a: 44, 45, ",        # two periods: not enough evidence
    "1, 2, 4, ",          # no constant step
    "ab, ab, ab, ",       # repetition without numbers: the suffix drafter's job
    "a: 43, 44, 45, 5",   # the number being written cannot be 46
    "a: 43, 44, 45,",     # the pattern wants " " next, not a digit ... and it ends with ",": fine
    "",
])
def test_no_pattern_no_draft(text):
    if text == "a: 43, 44, 45,":  # the period [,, ␣, NUM] rotates: " 46, 47" is the continuation
        assert draft(text) == " 46, 47, 48,"
    else:
        assert draft(text) == ""


def test_budget_and_zero_budget():
    assert draft("a: 43, 44, 45, ", budget=3) == "46,"
    assert draft("a: 43, 44, 45, ", budget=0) == ""


def test_a_number_cut_by_the_window_is_not_read():
    # The tail starts inside "143": read as 43 it would continue the progression 43, 44, 45.
    tail = enc("143, 144, 145, ")[1:]
    assert dec(_counting_draft(tail, digits=DIGITS, budget=4)) == ""


# ------------------------------------------------------------------ property
SEPS = st.lists(st.sampled_from(sorted(CHARS.values())), min_size=1, max_size=4)


@settings(max_examples=300, deadline=None)
@given(sep=SEPS, start=st.integers(0, 500), step=st.integers(-3, 5), periods=st.integers(4, 9),
       cut=st.integers(0, 40), budget=st.integers(1, 24))
@example(sep=[1], start=0, step=0, periods=4, cut=37, budget=24)  # CI: the text ran out before the draft
def test_a_rendered_progression_is_continued(sep, start, step, periods, cut, budget):
    """Render `periods` periods of NUM + sep, cut anywhere in the next ones: the draft is the true
    continuation (as long as the numbers stay >= 0), and it is never empty when the next number is >= 0."""
    # enough values that the rendered text outlasts cut + budget tokens (each value is >= 2 tokens)
    values = [start + i * step for i in range(periods + 60)]
    if min(values[:periods + 1]) < 0:
        return
    text_tokens = []
    for v in values:
        if v < 0:
            break
        text_tokens += [10 + int(c) for c in str(v)] + sep
    full = np.array(text_tokens, np.int64)
    seen = len(np.concatenate([[10 + int(c) for c in str(v)] + sep for v in values[:periods]]))
    tail, rest = full[: seen + cut], full[seen + cut:]
    out = _counting_draft(tail, digits=DIGITS, budget=budget)
    assert out.size <= budget
    assert np.array_equal(out, rest[: out.size]), (dec(tail), dec(out), dec(rest))
    if rest.size and values[periods] >= 0:
        assert out.size > 0


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 25), max_size=80), budget=st.integers(0, 20))
def test_any_tail_gives_a_valid_draft(tokens, budget):
    out = _counting_draft(np.array(tokens, np.int64), digits=DIGITS, budget=budget)
    assert out.size <= budget and out.dtype == np.int64
    assert set(out.tolist()) <= set(tokens) | set(DIGITS.tolist())


@settings(max_examples=200, deadline=None)
@given(data=st.data(), width=st.integers(1, 60), n_rows=st.integers(1, 6), wide=st.booleans())
def test_periods_read_in_a_token_table_match_the_tails(data, width, n_rows, wide):
    """The vLLM proposer reads its rows' tails in place (count_periods_rows): the same periods as the flat call
    on the tails copied out, for int32 and int64 tables."""
    from dasrl import _core

    vocab = st.sampled_from([1, 2, 3] + DIGITS.tolist())  # separators and digits: patterns are common
    table = np.array(data.draw(st.lists(st.lists(vocab, min_size=width, max_size=width), min_size=n_rows,
                                        max_size=n_rows)), np.int64 if wide else np.int32)
    rows = np.array(data.draw(st.lists(st.integers(0, n_rows - 1), max_size=8)), np.int64)
    start = np.array([data.draw(st.integers(0, width)) for _ in rows], np.int64)
    count = np.array([data.draw(st.integers(0, width - a)) for a in start.tolist()], np.int64)
    got = _core.count_periods_rows(table, rows, start, count, DIGITS, 8)
    tails = [table[r, a:a + c].astype(np.int64) for r, a, c in zip(rows, start, count)]
    np.testing.assert_array_equal(got, _periods(tails, DIGITS, 8))


# ------------------------------------------------------------------ the wrapper
def test_wrapper_counts_where_it_can_and_delegates_elsewhere():
    d = CountingDrafter(PromptLookup(), DIGITS)
    d.start("r", "p", enc("a:"))
    d.start("s", "p", enc("ab ab ab a"))
    d.observe("r", enc(" 43, 44, 45, "))
    out = d.propose(["r", "s"], [5, 3])
    assert dec(out[0].tokens) == "46, 4"  # counting
    assert dec(out[1].tokens) == "b a"  # the n-gram drafter's proposal
    assert d.counted == 1
    d.finish("r")
    with pytest.raises(KeyError):
        d.propose(["r"], [2])
    with pytest.raises(KeyError, match="already started"):
        d.start("s", "p", enc("a"))


@pytest.mark.parametrize("digits, match", [(np.arange(9), "10 distinct"), (np.zeros(10), "10 distinct")])
def test_bad_digits_are_refused(digits, match):
    with pytest.raises(ValueError, match=match):
        CountingDrafter(PromptLookup(), digits)


def test_digit_tokens_of_the_embedded_tokenizer(smollm):
    _, tok = smollm
    digits = digit_tokens(tok)
    assert [tok.decode([int(t)]) for t in digits] == list("0123456789")


# ------------------------------------------------------------------ exactness on the model
@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_counting_drafts_are_exact_on_the_model(smollm, temperature):
    from dasrl.drafter.store import DraftStore
    from dasrl.engine import EngineConfig, SamplingParams, SpecEngine
    from dasrl.policy.base import FixedBudget

    model, tok = smollm
    engine = SpecEngine(model, tok, EngineConfig(num_threads=1))
    chats = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
             for q in ("Count from 1 to 30, separated by commas.", "List the numbers from 10 to 40, one per line.")]
    prompts = [list(ids["input_ids"] if hasattr(ids, "keys") else ids) for ids in chats]
    sampling = SamplingParams(temperature=temperature)
    kw = dict(sampling=sampling, seeds=[7, 8], max_new_tokens=64)
    plain = engine.generate(prompts, **kw)
    drafter = CountingDrafter(DraftStore(), digit_tokens(tok))
    spec = engine.generate(prompts, drafter=drafter, policy=FixedBudget(8), **kw)
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    if temperature == 0.0:  # greedy counts: the test must have exercised counting
        assert drafter.counted > 0 and sum(c.accepted for c in spec) > 0


# ------------------------------------------------------------------ the session builds it
class _CharTokenizer:
    """A toy tokenizer, one id per character (the cases below break it)."""

    def encode(self, text, add_special_tokens=False):
        return [int(text)] if text.isdigit() else [ord(c) for c in text]

    def decode(self, ids):
        return "".join(str(i) for i in ids)


def test_digit_tokens_refuses_a_tokenizer_without_one_token_per_digit():
    class TwoTokens(_CharTokenizer):
        def encode(self, text, add_special_tokens=False):
            return [1, 2]
    with pytest.raises(ValueError, match="digit '0' is not a single token"):
        digit_tokens(TwoTokens())


def test_session_drafter_counting_on_off_and_without_digits(smollm):
    from dasrl.drafter.store import DraftStore
    from dasrl.rollout.session import SessionConfig, history_drafter

    _, tok = smollm
    on = history_drafter(SessionConfig(), tok)
    assert isinstance(on, CountingDrafter) and isinstance(on.inner, DraftStore)
    assert isinstance(history_drafter(SessionConfig(counting=False), tok), DraftStore)

    class NotDigits(_CharTokenizer):
        def decode(self, ids):
            return "x"
    with pytest.warns(UserWarning, match="counting drafts are off"):
        assert isinstance(history_drafter(SessionConfig(), NotDigits()), DraftStore)


def _items_spec(tail, digits):
    """The items of a tail, token by token (the vectorised counting._items must agree)."""
    digit_of = {int(t): str(d) for d, t in enumerate(digits.tolist())}
    keys, texts, run = [], [], ""
    for t in tail.tolist():
        d = digit_of.get(t)
        if d is not None:
            run += d
            continue
        if run:
            keys.append(_NUM)
            texts.append(run)
            run = ""
        keys.append(t)
        texts.append(None)
    if keys and keys[0] == _NUM and tail.size and digit_of.get(int(tail[0])) is not None:
        keys, texts = keys[1:], texts[1:]
    return keys, texts, run


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(DIGITS.tolist()), st.integers(0, 5)), max_size=40))
def test_vectorised_items_equal_the_token_by_token_spec(tokens):
    tail = np.array(tokens, np.int64)
    keys, text, partial = _items(tail, DIGITS)
    want_keys, want_texts, want_partial = _items_spec(tail, DIGITS)
    assert (keys, partial) == (want_keys, want_partial)
    assert [text(k) if key == _NUM else None for k, key in enumerate(keys)] == want_texts


def _period(keys, max_period):
    """The shortest P (with a number in it) such that the last three windows of P items are alike; 0 if none
    (the spec the batched counting._periods must agree with)."""
    n = len(keys)
    for p in range(1, min(max_period, n // 3) + 1):
        last = keys[n - p:]
        if _NUM in last and keys[n - 2 * p:n - p] == last and keys[n - 3 * p:n - 2 * p] == last:
            return p
    return 0


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.one_of(st.sampled_from(DIGITS.tolist()), st.integers(0, 3)), max_size=100), max_size=6),
       st.integers(1, 40))
def test_the_batched_periods_equal_each_rows_own(tails, max_period):
    """`_periods` (the whole batch at once, the proposal's filter) against `_period` of each row's items."""
    arrays = [np.array(t, np.int64) for t in tails]
    want = [_period(_items(t, DIGITS)[0], max_period) for t in arrays]
    assert _periods(arrays, DIGITS, max_period).tolist() == want


def test_the_batched_periods_find_a_rendered_count():
    tails = [enc("a: 41, 42, 43, 44, 4"), enc("ab, a:b"), np.zeros(0, np.int64), enc("123")]
    assert _periods(tails, DIGITS, 32).tolist() == [_period(_items(t, DIGITS)[0], 32) for t in tails]
    assert _periods(tails, DIGITS, 32)[0] > 0
