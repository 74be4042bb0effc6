"""Shared fixtures (the library's tests and the lab's, tests/lab/): the embedded SmolLM2 model (converted once,
cached), loaded once per session.

DASRL_BLOCK_LAB=1 makes `dasrl_lab` unimportable and leaves tests/lab/ uncollected: the library's tests alone,
as where the lab is not installed (`make test-lib`)."""

from __future__ import annotations

import os

import pytest

if os.environ.get("DASRL_BLOCK_LAB") == "1":
    from support import block_lab

    block_lab.install()
    collect_ignore = ["lab"]

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


def _tiny(family: str):
    """A factory of small random models of a transformers family (vocab 97, 2 layers, grouped-query heads 4/2),
    seeded: each call builds a fresh model in eval mode, so a test may change its weights."""
    torch = pytest.importorskip("torch")
    import transformers

    config_cls, model_cls = (getattr(transformers, f"{family}{suffix}") for suffix in ("Config", "ForCausalLM"))

    def make(seed: int = 0):
        torch.manual_seed(seed)
        cfg = config_cls(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
        return model_cls(cfg).eval()
    return make


@pytest.fixture(scope="session")
def tiny_llama():
    """Small random Llama models (_tiny)."""
    return _tiny("Llama")


@pytest.fixture(scope="session")
def tiny_qwen2():
    """Small random Qwen2 models (_tiny; Qwen2: biased q/k/v projections, full attention in every layer)."""
    return _tiny("Qwen2")
