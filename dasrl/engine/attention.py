"""The engine's attention, registered with transformers: packed rows (packing.py), each over its own cache.

Grouped-query heads are folded into the query axis (q [B, H, q, D] -> [B, Hkv, G*q, D], the mask tiled G
times) so one SDPA call attends over un-repeated K/V: transformers' stock SDPA repeats K/V whenever a 4D mask
has several queries per row, a slow path on CPU. It computes nothing else: a forward without the packed
layout, or a layer asking for a sliding window or softcap, raises (SpecEngine's probe names the model type).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch
import torch.nn.functional as F

_ATTN_NAME = "dasrl_gqa"  # its name in transformers' AttentionInterface


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, H, q, D] -> [B, Hkv, G*q, D]: the query heads of each K/V group along the query axis."""
    b, h, n, d = q.shape
    return q.reshape(b, kv_heads, (h // kv_heads) * n, d)


def _packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout,
                     scaling: float | None) -> torch.Tensor:
    """Packed queries [1, H, N, D] over per-row caches key/value [rows, Hkv, cap, D] (the new tokens' K/V
    written), as `layout` (a packing._PackedLayout) says: [1, N, H, D]."""
    _, heads, n, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    q = query[0].transpose(0, 1)  # [N, H, D]
    out = query.new_empty(n, heads, dim)  # [N, H, D]
    # Every row's first token: one query per row, the live rows' cache as it lies.
    m1 = layout.first_mask  # [B, 1, 1, S1]
    batch, s1 = m1.shape[0], m1.shape[-1]
    q1 = _grouped(q[layout.first][:, :, None, :], kv_heads)  # [B, Hkv, G, D]
    if layout.first_groups:
        o1 = _first_invariant(q1, key, value, layout, scaling)  # [B, Hkv, G, D]
    else:
        o1 = F.scaled_dot_product_attention(q1, key[:batch, :, :s1], value[:batch, :, :s1],
                                            attn_mask=m1, scale=scaling)  # [B, Hkv, G, D]
    out[layout.first] = o1.reshape(batch, heads, dim)
    if layout.more_views:
        _more_invariant(q, key, value, layout, scaling, out)
    elif layout.more_rows.numel():
        m2 = layout.more_mask  # [R, 1, Q, S2]
        r, qn, s2 = m2.shape[0], m2.shape[2], m2.shape[3]
        idx = layout.more_index  # [R, Q]
        q2 = _grouped(q[idx.reshape(-1)].reshape(r, qn, heads, dim).transpose(1, 2), kv_heads)  # [R, Hkv, G*Q, D]
        mask = m2.repeat(1, 1, groups, 1) if groups > 1 else m2  # [R, 1, G*Q, S2]
        if key.device.type == "cpu":  # each row's cache as a view: one call per row beats copying their K/V
            o2 = torch.cat([F.scaled_dot_product_attention(q2[i : i + 1], key[b : b + 1, :, :s],
                                                           value[b : b + 1, :, :s],
                                                           attn_mask=mask[i : i + 1, :, :, :s], scale=scaling)
                            for i, (b, s) in enumerate(layout.more_spans)])  # [R, Hkv, G*Q, D]
        else:  # a GPU: one call over a copy of those rows' K/V (fewer kernel launches)
            k2 = key[layout.more_rows, :, :s2]  # [R, Hkv, S2, D]
            v2 = value[layout.more_rows, :, :s2]
            o2 = F.scaled_dot_product_attention(q2, k2, v2, attn_mask=mask, scale=scaling)  # [R, Hkv, G*Q, D]
        o2 = o2.reshape(r, heads, qn, dim).transpose(1, 2)  # [R, Q, H, D]
        valid = layout.more_valid  # [R, Q]
        out[idx[valid]] = o2[valid]
    return out[None]  # [1, N, H, D]


def _first_invariant(q1: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout,
                     scaling: float | None) -> torch.Tensor:
    """First tokens q1 [B, Hkv, G, D] by view group (layout.first_groups): no shape depends on other rows."""
    o1 = torch.empty_like(q1)  # [B, Hkv, G, D]
    for a, b, s, row0 in layout.first_groups:
        if row0 >= 0:
            rows = slice(row0, row0 + b - a)
            o1[rows] = F.scaled_dot_product_attention(q1[rows], key[rows, :, :s], value[rows, :, :s],
                                                      attn_mask=layout.first_mask[rows, :, :, :s], scale=scaling)
        else:
            idx = layout.first_order[a:b]  # [n]
            o1[idx] = F.scaled_dot_product_attention(
                q1[idx], key[:, :, :s].index_select(0, idx), value[:, :, :s].index_select(0, idx),
                attn_mask=layout.first_mask[idx, :, :, :s], scale=scaling)  # [n, Hkv, G, D]
    return o1


def _more_invariant(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout, scaling: float | None,
                    out: torch.Tensor) -> None:
    """Tokens 1.. of each multi-token row (q [N, H, D]), each one query over its own view (layout.more_views),
    written into out [N, H, D]."""
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = key.shape[1]
    for i, ((b, _), views) in enumerate(zip(layout.more_spans, layout.more_views)):
        for a, c, s in views:
            n = c - a
            idx = layout.more_index[i, a:c]  # [n]
            qi = _grouped(q[idx][:, :, None, :], kv_heads)  # [n, Hkv, G, D]
            mask = layout.more_mask[i, 0, a:c, :s][:, None, None, :]  # [n, 1, 1, s]: cache and own ancestors
            oi = F.scaled_dot_product_attention(qi, key[b : b + 1, :, :s].expand(n, -1, -1, -1),
                                                value[b : b + 1, :, :s].expand(n, -1, -1, -1), attn_mask=mask,
                                                scale=scaling)  # [n, Hkv, G, D] (K/V broadcast, not copied)
            out[idx] = oi.reshape(n, heads, dim)


# Keywords a layer passes to attention that change nothing here; any other one with a value (a sliding window,
# a softcap, sinks, ...) would be ignored, so it is refused.
_CARRIED = frozenset({"dasrl_packed", "position_ids", "use_cache", "output_attentions"})


class PackedLayoutMissing(RuntimeError):
    """The engine's attention ran without the packed layout: a layer did not forward `dasrl_packed`."""


class ModelInRollout(RuntimeError):
    """A forward of the model from another thread while a SpecEngine forward context holds it."""


_ENGINE = threading.local()  # .active: this thread is inside an engine forward context


@contextlib.contextmanager
def engine_thread() -> Iterator[None]:
    outer = getattr(_ENGINE, "active", False)
    _ENGINE.active = True
    try:
        yield
    finally:
        _ENGINE.active = outer


def require_engine_thread(module: torch.nn.Module) -> None:
    if not getattr(_ENGINE, "active", False):
        raise ModelInRollout(
            f"{type(module).__name__} was called from a thread that is not the rollout's while a dasrl rollout "
            f"holds the model (SpecEngine.generate swaps its attention and linear layers until it returns): run "
            f"the trainer's forward and backward between generate() calls, or hold dasrl.engine.model_lock(model) "
            f"around them")


def _engine_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """The engine's attention: every forward is packed (`dasrl_packed=`). No fallback: without the layout any
    attention computed here would be wrong, equally in plain and speculative runs, which no test would see."""
    layout = kwargs.get("dasrl_packed")
    if layout is None:
        require_engine_thread(module)
        raise PackedLayoutMissing(
            f"{type(module).__name__} reached the engine's attention without the packed layout: a layer of "
            f"this model does not pass its keyword arguments (dasrl_packed=) through to attention")
    unknown = sorted(k for k, v in kwargs.items() if v is not None and k not in _CARRIED)
    if unknown:
        raise NotImplementedError(f"{type(module).__name__} asks attention for {unknown}, which the engine's "
                                  f"packed attention does not implement")
    return _packed_attention(query, key, value, layout, scaling), None


def register() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(_ATTN_NAME, _engine_attention)
    return _ATTN_NAME


@contextlib.contextmanager
def attention_implementation(model: torch.nn.Module, name: str) -> Iterator[None]:
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = previous


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """The model in eval mode inside the block; each module's training flag restored after."""
    training = [m for m in model.modules() if m.training]
    model.eval()
    try:
        yield
    finally:
        for m in training:
            m.training = True
