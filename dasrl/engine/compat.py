"""What the engine needs from transformers that differs between the releases it supports (5.5.3 to 5.25).

- The decoder's KV cache keyword: `past_key_values=` up to 5.23, `cache=` from 5.24. An unknown keyword is no
  error in any release (it reaches attention through **kwargs: issue 42), so it is read from the signature.
- The layer cache's capacity method: `get_max_cache_shape()` up to 5.12, `get_max_length()` from 5.13.
- Relied on as unchanged: `Cache(layers=[...])`; a layer's `update(key, value, *args, **kwargs)` returns what
  attention reads; `get_mask_sizes(query_length)`; a 4D `attention_mask` passes `create_causal_mask`
  untouched; given `position_ids` mean no `get_seq_length()` call; no `cache_position` in Llama or Qwen2;
  `AttentionInterface.register`; a settable `config._attn_implementation`; `_supports_attention_backend`.
"""

from __future__ import annotations

import inspect

import torch

_CACHE_KEYWORDS = ("cache", "past_key_values")  # newest first


class CacheKeywordMissing(TypeError):
    """A decoder forward names no KV cache keyword the engine knows."""


def cache_keyword(module: torch.nn.Module) -> str:
    """The keyword under which `module.forward` (a decoder) takes its KV cache, read from its signature
    (functools.wraps keeps it); a cache under a name it does not declare would reach attention unused."""
    params = inspect.signature(module.forward).parameters
    for name in _CACHE_KEYWORDS:
        if name in params:
            return name
    raise CacheKeywordMissing(f"{type(module).__name__}.forward takes none of {list(_CACHE_KEYWORDS)} (its "
                              f"parameters: {list(params)}): the engine cannot hand it its KV cache")


class LayerCompat:
    """Mixin for a CacheLayerMixin subclass defining `get_max_length()`: its old name, abstract up to 5.12."""

    def get_max_cache_shape(self) -> int:
        return self.get_max_length()
