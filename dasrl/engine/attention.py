"""Grouped-query SDPA without repeating K/V, registered with transformers for the engine's forwards.

transformers' stock SDPA attention repeats K/V for grouped-query heads whenever a custom 4D mask is
given with more than one query token per row, a slow path on CPU. Here the query heads of each K/V
group are folded into the query-length axis instead: q [B, H, q, D] -> [B, Hkv, G*q, D], the mask is
tiled G times along its query axis, and one SDPA call attends over the un-repeated K/V. The result is
the same attention, computed without materialising [B, H, S, D] keys and values.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F

ATTN_NAME = "dasrl_gqa"
"""Name the attention function is registered under in transformers' AttentionInterface."""


def gqa_sdpa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """The attention_interface signature of transformers: returns ([B, q, H, D], None)."""
    batch, heads, q_len, dim = query.shape  # query: [B, H, q, D]
    kv_heads = key.shape[1]  # key, value: [B, Hkv, S, D]
    groups = heads // kv_heads
    q = query.reshape(batch, kv_heads, groups * q_len, dim)  # [B, Hkv, G*q, D]
    mask = attention_mask
    if mask is not None and groups > 1:
        mask = mask.repeat(1, 1, groups, 1)  # [B, 1, G*q, S]
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, dropout_p=0.0, scale=scaling,
                                         is_causal=mask is None and q_len > 1)  # [B, Hkv, G*q, D]
    out = out.reshape(batch, heads, q_len, dim).transpose(1, 2).contiguous()  # [B, q, H, D]
    return out, None


def register() -> str:
    """Register the function with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, gqa_sdpa_forward)
    return ATTN_NAME


@contextlib.contextmanager
def attention_implementation(model: torch.nn.Module, name: str) -> Iterator[None]:
    """Use attention `name` for the model's forwards inside the block; restore the previous one after."""
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = previous
