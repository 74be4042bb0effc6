"""Which models the engine runs exactly, checked when a SpecEngine binds a model.

A model that does not pass `dasrl_packed=` through to attention, or attends other than full causal, would not
fail: its plain and speculative outputs would be equally wrong. So it is refused, its type named, when its
config declares something else (`unsupported_reason`) or a tiny packed forward's logits differ from the
model's own (`_probe_error`).
"""

from __future__ import annotations

import numpy as np
import torch

from dasrl.drafter.base import Draft, DraftBatch
from dasrl.engine.attention import eval_mode
from dasrl.engine.cache import RowCache
from dasrl.engine.packing import pack_drafts, pack_prompts

# Largest probe error relative to the largest logit. Measured on random models: fp32 1e-7 to 6e-7, bf16 2e-3
# to 8e-3; without the causal mask among a row's new tokens, 0.25 to 0.93.
_TOLERANCE = {torch.float32: 1e-4}
_HALF_TOLERANCE = 5e-2


class UnsupportedModel(ValueError):
    """The engine cannot run this model exactly (SpecEngine refuses it at construction)."""


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why the engine's packed attention cannot compute what this model's does (None: none known; the probe
    still checks the logits), from the transformers 5.x config."""
    if not getattr(model, "_supports_attention_backend", False):
        return ("its attention is not declared to take transformers' attention interface with every keyword "
                "argument passed through (_supports_attention_backend)")
    cfg = model.config.get_text_config()
    window = getattr(cfg, "sliding_window", None)
    if window:  # Mistral, Qwen2 with use_sliding_window, Gemma 2/3, ...
        return f"sliding-window attention (sliding_window={window})"
    chunk = getattr(cfg, "attention_chunk_size", None)
    if chunk:  # Llama 4
        return f"chunked attention (attention_chunk_size={chunk})"
    kinds = sorted(set(getattr(cfg, "layer_types", None) or ()) - {"full_attention"})
    if kinds:
        return f"layers of type {kinds} (the engine implements full causal attention only)"
    return None


def check_packed_forward(engine) -> None:
    try:
        err = _probe_error(engine)
    except Exception as e:
        raise UnsupportedModel(f"SpecEngine does not support model type {engine.model_type!r}: its packed "
                               f"forward fails ({type(e).__name__}: {e})") from e
    tol = _TOLERANCE.get(engine.lm_head.weight.dtype, _HALF_TOLERANCE)
    if not err <= tol:
        raise UnsupportedModel(
            f"SpecEngine does not support model type {engine.model_type!r}: its packed forward's logits differ "
            f"from the model's own forward by {err:.3g} of the largest logit (tolerance {tol:g}); a layer may "
            f"not pass dasrl_packed= through to attention, or attend in a way the engine does not implement")


def _probe_error(engine) -> float:
    """A packed prefill of two rows of different lengths, then a step with a 2-token draft in one row, against
    the model's own forward at every position: the largest logit difference relative to the largest logit."""
    v = engine.vocab_size
    prompts = [[(7 * i + 3) % v for i in range(5)], [(11 * i + 5) % v for i in range(3)]]
    pending, draft = [13 % v, 17 % v], [19 % v, 23 % v]
    with engine.forward_context():
        cache = RowCache.for_model(engine.model, rows=2, capacity=8)  # small: the step grows it
        pre = pack_prompts(prompts, bucket=engine.attention_bucket)
        first = engine._forward(cache, pre)  # [8, V]: every prompt token
        cache.lengths[:2] = [5, 3]
        step = pack_drafts(pending=np.array(pending, np.int64), lengths=cache.lengths[:2].copy(),
                           drafts=DraftBatch.from_drafts([Draft.chain(draft), Draft.empty()]),
                           bucket=engine.attention_bucket)
        second = engine._forward(cache, step)  # [4, V]
    ours = [torch.cat([first[:5], second[:3]]), torch.cat([first[5:], second[3:]])]
    err, device = 0.0, engine.model.get_input_embeddings().weight.device
    with eval_mode(engine.model), torch.inference_mode():
        for got, seq in zip(ours, [prompts[0] + [pending[0]] + draft, prompts[1] + [pending[1]]]):
            want = engine.model(input_ids=torch.tensor([seq], device=device)).logits[0].float().to(got.device)
            err = max(err, float((got.float() - want).abs().max()) / max(1.0, float(want.abs().max())))
    return err
