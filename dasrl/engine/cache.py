"""A KV cache in which every row of the batch has its own length (docs/engine.md).

Before a forward the engine says where each packed token goes (`prepare_packed`); a layer's `update()`
scatters the new K/V there and hands attention the whole cache. Row lengths are committed only after
verification, so rejected draft tokens are simply overwritten by the next write and a failed step leaves
every row as it was. Finished rows leave by swap-remove, so the live rows are always the prefix [0, live).
"""

from __future__ import annotations

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from dasrl.engine.compat import LayerCompat


class _RowLayer(LayerCompat, CacheLayerMixin):
    """One layer's K/V [rows, Hkv, capacity, D]: per-row writes at engine-chosen slots."""

    is_compileable = False
    is_sliding = False

    def __init__(self, owner: "RowCache", keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.owner = owner
        self.keys = keys  # [rows, Hkv, capacity, D]
        self.values = values  # [rows, Hkv, capacity, D]
        self.is_initialized = True
        self.dtype, self.device = keys.dtype, keys.device

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # preallocated

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        rows, slots = self.owner.write_rows, self.owner.write_slots  # [1, N] each
        self.keys[rows, :, slots] = key_states.transpose(1, 2)  # [1, N, Hkv, D] into [rows, Hkv, S, D]
        self.values[rows, :, slots] = value_states.transpose(1, 2)
        return self.keys, self.values  # [rows, Hkv, capacity, D]: packed attention slices each row's slots

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.view_len, 0

    def get_seq_length(self) -> int:
        return int(self.owner.lengths.max(initial=0))

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class RowCache(Cache):
    """Per-row-offset KV cache for a batch of `rows` sequences of up to `capacity` tokens (grows)."""

    def __init__(self, *, num_layers: int, rows: int, kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        shape = (rows, kv_heads, capacity, head_dim)
        layers = [_RowLayer(self, torch.zeros(shape, dtype=dtype, device=device),
                           torch.zeros(shape, dtype=dtype, device=device)) for _ in range(num_layers)]
        super().__init__(layers=layers)
        self.lengths = np.zeros(rows, dtype=np.int64)  # [rows] committed tokens (valid K/V in slots [0, length))
        self.live = rows  # live rows: always the prefix [0, live)
        self.write_rows = self.write_slots = torch.zeros(1, 0, dtype=torch.long)  # [1, N] each, set per forward
        self.view_len = 0

    @classmethod
    def for_model(cls, model: torch.nn.Module, *, rows: int, capacity: int) -> "RowCache":
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        param = next(model.parameters())
        return cls(num_layers=cfg.num_hidden_layers, rows=rows, kv_heads=cfg.num_key_value_heads,
                   head_dim=head_dim, capacity=capacity, dtype=param.dtype, device=param.device)

    @property
    def capacity(self) -> int:
        return self.layers[0].keys.shape[2]

    @property
    def device(self) -> torch.device:
        return self.layers[0].keys.device

    def ensure_capacity(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        new_cap = max(needed, int(self.capacity * 1.5)) + 63 & ~63
        for layer in self.layers:
            for name in ("keys", "values"):
                old = getattr(layer, name)
                new = old.new_zeros((old.shape[0], old.shape[1], new_cap, old.shape[3]))
                new[:, :, : old.shape[2]] = old
                setattr(layer, name, new)

    def prepare_packed(self, rows: torch.Tensor, slots: torch.Tensor, view_len: int) -> None:
        """The next forward is packed: token n goes to row rows[n], slot slots[n] ([N] each)."""
        if rows.numel() and int(rows.max()) >= self.live:  # host tensors: no device sync
            raise ValueError(f"packed tokens for row {int(rows.max())} but {self.live} rows are live")
        self.ensure_capacity(max(view_len, int(slots.max()) + 1))
        self.write_rows, self.write_slots = rows[None].to(self.device), slots[None].to(self.device)  # [1, N]
        self.view_len = view_len

    def move_slots(self, row: int, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy K/V of `row` from slots src to slots dst (a tree's accepted path made contiguous)."""
        src_t = torch.as_tensor(src, dtype=torch.long, device=self.device)
        dst_t = torch.as_tensor(dst, dtype=torch.long, device=self.device)
        for layer in self.layers:
            layer.keys[row, :, dst_t] = layer.keys[row, :, src_t]
            layer.values[row, :, dst_t] = layer.values[row, :, src_t]

    def remove_row(self, row: int) -> None:
        """Drop live row `row`: the last live row takes its place."""
        last = self.live - 1
        if not 0 <= row <= last:
            raise IndexError(f"row {row} is not live (live rows: {self.live})")
        if row != last:
            n = int(self.lengths[last])
            for layer in self.layers:
                layer.keys[row, :, :n] = layer.keys[last, :, :n]
                layer.values[row, :, :n] = layer.values[last, :, :n]
            self.lengths[row] = self.lengths[last]
        self.lengths[last] = 0
        self.live = last
