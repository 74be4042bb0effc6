"""Shared fixtures: the embedded SmolLM2 model (converted once, cached), loaded once per session."""

from __future__ import annotations

import pytest

CHAT_PROMPTS = [
    "What is 2+2?",
    "List three prime numbers.",
    "Explain gravity to a child in two sentences.",
    "Hi",
    "Translate 'good morning' into French and German.",
    "What is the capital of France? Answer in one word.",
    "Write a Python function that returns the square of a number, with a docstring.",
    "Name the planets of the solar system in order from the sun, separated by commas, and add one fact.",
]


@pytest.fixture(scope="session")
def smollm():
    """(model, tokenizer): SmolLM2-135M-Instruct in float32, eval mode."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from dasrl.models import load_model

    model, tokenizer = load_model("smollm2-135m", dtype=torch.float32)
    return model, tokenizer


@pytest.fixture(scope="session")
def chat_prompts(smollm):
    """Eight chat-formatted prompts of different lengths, as token-id lists."""
    _, tok = smollm
    out = []
    for text in CHAT_PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    assert len(out) == 8 and len({len(p) for p in out}) == 8
    return out
