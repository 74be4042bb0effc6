"""Line stops (dasrl/engine/stops.py): a request ends with the newline that closes a line holding a phrase,
at the same token whether decoding is plain or speculative."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from dasrl.engine import EngineConfig, SamplingParams, SpecEngine  # noqa: E402
from dasrl.engine.stops import LineStop  # noqa: E402
from dasrl.policy.base import FixedBudget  # noqa: E402
from support.drafters import Oracle  # noqa: E402


def _expected_cut(tok, ids: list[int], phrase: str) -> int | None:
    """Tokens kept under the stop, found independently: grow the text token by token and stop at the first
    token that adds a newline while the line it closes holds the phrase."""
    for n in range(1, len(ids) + 1):
        before, text = tok.decode(ids[:n - 1]), tok.decode(ids[:n])
        if "\n" in text[len(before):]:
            closed = text[:len(before) + text[len(before):].index("\n")]
            if phrase in closed.rsplit("\n", 1)[-1]:
                return n
    return None


def test_line_stop_by_hand(smollm):
    _, tok = smollm
    stop = LineStop(("The answer is",), tok)
    ids = tok("Work.\nThe answer is 12.\n\nMore")["input_ids"]
    hits = [n for n in range(1, len(ids) + 1) if stop.hit(ids[:n])]
    assert tok.decode(ids[:hits[0]]) == "Work.\nThe answer is 12.\n"  # the first hit: the answer line's newline
    assert tok.decode(ids[:3]) == "Work.\n" and not stop.hit(ids[:3])  # a newline, but no phrase on the line
    with pytest.raises(ValueError, match="one-line strings"):
        LineStop(("a\nb",), tok)
    with pytest.raises(ValueError, match="need a tokenizer"):
        LineStop(("x",), None)


def test_stop_lines_cut_plain_and_speculative_at_the_same_token(smollm):
    model, tok = smollm
    engine = SpecEngine(model, tok, EngineConfig(num_threads=1))
    ask = [f"Write the numbers from {a} to {a + 9}, one per line." for a in (1, 11, 21, 31)]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True) for q in ask]
    prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]
    seeds = [11, 12, 13, 14]
    sampling = SamplingParams(temperature=0.7, top_p=1.0)
    phrase = "5"  # a line holding a 5 ends the sample: in the middle of most of these lists
    free = engine.generate(prompts, seeds=seeds, sampling=sampling, max_new_tokens=40)
    plain = engine.generate(prompts, seeds=seeds, sampling=sampling, max_new_tokens=40, stop_lines=(phrase,))
    spec = engine.generate(prompts, seeds=seeds, sampling=sampling, max_new_tokens=40, stop_lines=(phrase,),
                           drafter=Oracle({i: c.token_ids for i, c in enumerate(free)}),
                           policy=FixedBudget(8))
    cut = 0
    for f, p, s in zip(free, plain, spec):
        n = _expected_cut(tok, f.token_ids, phrase)
        if n is None or f.finish_reason == "stop" and len(f.token_ids) <= n:  # ended before any such line
            assert p.token_ids == f.token_ids
        else:
            assert p.token_ids == f.token_ids[:n] and p.finish_reason == "stop"  # a prefix: same seeds
            cut += 1
        assert s.token_ids == p.token_ids and s.finish_reason == p.finish_reason
    assert cut >= 2  # the stop did fire: the test is not vacuous
