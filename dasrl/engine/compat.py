"""What the engine needs from transformers that differs between the releases it supports, in one place.

Read in each release's installed source (modeling_llama.py, modeling_qwen2.py, cache_utils.py,
masking_utils.py); everything not listed here is the same from 5.5.3 to 5.25:

- The KV cache keyword of a decoder's forward (model, decoder layer and attention module alike):
  ``past_key_values=`` up to 5.23, ``cache=`` from 5.24 (``past_key_values`` deprecated there). A
  keyword the forward does not name is not an error in any release: it falls into ``**kwargs`` and is
  handed on to the attention function (the 5.19 failure of issue 42: ``cache=`` reached attention and
  the engine's RowCache was never used as a cache). So the name is read from the forward's signature,
  per model, not guessed from the release.
- The layer cache's capacity: the abstract ``CacheLayerMixin`` method is ``get_max_cache_shape()`` up to
  5.12, ``get_max_length()`` from 5.13 (``get_max_cache_shape()`` a deprecated alias until 5.19, gone
  from 5.20). A layer defines both (``LayerCompat``), else it cannot be instantiated on one side.
- Unchanged across the range, and relied on: ``Cache(layers=[...])``; a layer's ``update(key, value,
  *args, **kwargs)`` returns the tensors attention reads (5.25 adds ``kwargs=`` to the call);
  ``get_mask_sizes(query_length) -> (kv_length, kv_offset)``; a 4D ``attention_mask`` is returned
  untouched by ``create_causal_mask``; ``position_ids`` given means no ``get_seq_length()`` call; no
  ``cache_position`` argument in Llama or Qwen2 (none from 5.5.3 on); ``AttentionInterface.register``;
  ``config._attn_implementation`` settable to a registered name; ``_supports_attention_backend``.
"""

from __future__ import annotations

import inspect

import torch

_CACHE_KEYWORDS = ("cache", "past_key_values")
"""The KV cache keyword, newest first: `cache` (transformers >= 5.24), `past_key_values` (5.x before)."""


class CacheKeywordMissing(TypeError):
    """A decoder forward names no KV cache keyword the engine knows."""


def cache_keyword(module: torch.nn.Module) -> str:
    """The keyword under which `module.forward` (a decoder) takes its KV cache, read from its signature
    (transformers' decorators keep it: functools.wraps). A forward that names neither known keyword is
    refused: passing the cache under a name it does not declare would hand it to attention unused."""
    params = inspect.signature(module.forward).parameters
    for name in _CACHE_KEYWORDS:
        if name in params:
            return name
    raise CacheKeywordMissing(f"{type(module).__name__}.forward takes none of {list(_CACHE_KEYWORDS)} (its "
                              f"parameters: {list(params)}): the engine cannot hand it its KV cache")


class LayerCompat:
    """Mixin for a CacheLayerMixin subclass defining `get_max_length()`: the old name of the same method,
    abstract in transformers <= 5.12 (`get_max_cache_shape`), so the layer is concrete in every release."""

    def get_max_cache_shape(self) -> int:
        return self.get_max_length()
