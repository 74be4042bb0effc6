"""The packed forward's inputs: every live row's new tokens laid end to end, no padding (docs/engine.md).

Row b feeds q_b tokens (the prefill: its prompt; a step: its pending token, then its draft nodes) at KV slots
L_b .. L_b + q_b - 1; each sees the row's cache and its own ancestors among the new tokens. Attention runs in
two groups: every row's first token (one query per row), then the other tokens of the rows with q_b > 1,
gathered [R, q_max - 1]. Batch-invariant layouts (bucket=W) give every token attention shapes that depend on
that token alone: its own view (slot + 1) rounded up to a multiple of W (docs/sampling.md "Batch invariance").
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from dasrl.drafter.base import DraftBatch, offsets_of

INVARIANT_BUCKET = 64  # batch-invariant layouts round each token's view up to a multiple of this many slots


@dataclass(frozen=True)
class _PackedLayout:
    """Where each packed token goes and what it sees (built by `_pack`; read by the cache and attention)."""

    rows: torch.Tensor  # [N] int64: the row of each packed token
    slots: torch.Tensor  # [N] int64: its KV slot in that row (L_b + local index)
    first: torch.Tensor  # [B] int64: packed index of each row's first token
    first_mask: torch.Tensor  # [B, 1, 1, S1] bool: slots each first token sees; S1 = max L_b + 1 (or largest view)
    more_rows: torch.Tensor  # [R] int64: the rows with more than one new token
    more_index: torch.Tensor  # [R, Q] int64: packed index of their tokens 1..q_b-1, padded with the first's
    more_valid: torch.Tensor  # [R, Q] bool: which entries of more_index are real tokens
    more_mask: torch.Tensor  # [R, 1, Q, S2] bool: slots each sees; S2 = max L_b + q_b over them (or bucketed)
    more_spans: tuple[tuple[int, int], ...] = ()  # host (row, L_b + q_b) of the R rows: CPU attention's views
    # Batch-invariant layouts only. first_order [B]: the rows sorted by first-token view (stable); first_groups
    # (a, b, S, row0): rows first_order[a:b] attend over S slots (row0 >= 0: they are row0, row0 + 1, ...);
    # more_views, per multi-token row, (a, b, S): its tokens a..b-1 after the first, one query each over S slots.
    first_order: torch.Tensor | None = None
    first_groups: tuple[tuple[int, int, int, int], ...] = ()
    more_views: tuple[tuple[tuple[int, int, int], ...], ...] = ()

    @property
    def tokens(self) -> int:
        return int(self.rows.shape[0])

    def to(self, device: torch.device | str) -> "_PackedLayout":
        if self.rows.device == torch.device(device):
            return self
        return _PackedLayout(**{f: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                               for f in self.__dataclass_fields__ for v in (getattr(self, f),)})


@dataclass(frozen=True)
class PackedInputs:
    """One packed forward's inputs, plus what sampling and verification need to read its outputs."""

    ids: torch.Tensor  # [1, N] int64: the packed input tokens
    positions: torch.Tensor  # [1, N] int64: rotary positions (L_b + depth in the row's tree)
    layout: _PackedLayout
    starts: np.ndarray  # [B+1] int64: row b's tokens are packed [starts[b], starts[b+1])
    depth: np.ndarray  # [N] int64: depth in the row's tree (the first token 0): its output-position offset
    view: int  # KV slots the forward touches: max over rows of L_b + q_b

    def to(self, device: torch.device | str) -> "PackedInputs":
        if self.ids.device == torch.device(device):
            return self
        return replace(self, ids=self.ids.to(device, non_blocking=True),  # starts and depth stay on the host
                       positions=self.positions.to(device, non_blocking=True), layout=self.layout.to(device))


def _closure(local_parent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Ancestor-or-self matrix [R, Q, Q] and depth [R, Q] of forests of local parents [R, Q] (-1 = root or
    padding), by pointer doubling."""
    r, q = local_parent.shape
    anc = np.broadcast_to(np.eye(q, dtype=bool), (r, q, q)).copy()  # [R, Q, Q]
    depth = (local_parent >= 0).astype(np.int64)  # [R, Q] distance to the jump target
    jump = local_parent.copy()  # [R, Q]
    rr = np.arange(r)[:, None]
    while (jump >= 0).any():
        has = jump >= 0  # [R, Q]
        j = np.where(has, jump, 0)
        anc |= anc[rr, j] & has[:, :, None]
        depth = depth + np.where(has, depth[rr, j], 0)
        jump = np.where(has, jump[rr, j], -1)
    return anc, depth


def _round_up(x, bucket: int):
    return -(-x // bucket) * bucket


def _first_groups(lengths: np.ndarray, bucket: int) -> tuple[np.ndarray, tuple[tuple[int, int, int, int], ...]]:
    """Rows grouped by their own first-token view, L_b + 1 rounded up to the bucket: the order [B] and
    _PackedLayout.first_groups."""
    view = _round_up(lengths + 1, bucket)  # [B]
    order = np.argsort(view, kind="stable")  # [B]
    cuts = np.flatnonzero(np.diff(view[order])) + 1
    groups = []
    for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), len(order)]):
        rows = order[a:b]
        row0 = int(rows[0]) if rows[-1] - rows[0] == b - a - 1 else -1
        groups.append((a, b, int(view[rows[0]]), row0))
    return order, tuple(groups)


def _more_views(lengths: np.ndarray, extra: np.ndarray, bucket: int) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """Per multi-token row (cache lengths [R], extra tokens [R]): its extra tokens in runs (a, b, S) of equal
    view S = (own slot + 1) rounded up to the bucket."""
    out = []
    for length, k in zip(lengths.tolist(), extra.tolist()):
        views = _round_up(length + 2 + np.arange(k), bucket)  # [k] token j sits at slot length + 1 + j
        cuts = [0, *(np.flatnonzero(np.diff(views)) + 1).tolist(), k]
        out.append(tuple((a, b, int(views[a])) for a, b in zip(cuts[:-1], cuts[1:])))
    return tuple(out)


def _pack(*, first_ids: np.ndarray, lengths: np.ndarray, more_ids: np.ndarray, more_offsets: np.ndarray,
         more_parents: np.ndarray, bucket: int = 0) -> PackedInputs:
    """Row b feeds first_ids[b], then more_ids[more_offsets[b]:more_offsets[b+1]] whose parents (indices into
    that segment, -1 = the first token) are more_parents (same slice). bucket > 0: batch-invariant."""
    batch = len(first_ids)
    lengths = np.asarray(lengths, np.int64)  # [B]
    n = np.diff(np.asarray(more_offsets, np.int64))  # [B] extra tokens per row
    q = 1 + n  # [B]
    starts = offsets_of(q)  # [B+1]
    total = int(starts[-1])
    row_of = np.repeat(np.arange(batch), q)  # [N]
    local = np.arange(total) - starts[row_of]  # [N] index within the row
    ids = np.empty(total, np.int64)
    ids[starts[:-1]] = first_ids
    extra = local > 0  # [N]
    ids[extra] = more_ids
    parent = np.full(total, -1, np.int64)  # [N] local parent; the first token is every tree's root
    parent[extra] = np.asarray(more_parents, np.int64) + 1

    more_rows = np.flatnonzero(n > 0)  # [R]
    width = int(q.max())
    depth = np.zeros(total, np.int64)
    r = len(more_rows)
    lp = np.full((r, width), -1, np.int64)  # [R, Q+1] local parents, padded
    valid = np.zeros((r, width), bool)
    if r:
        sel = n[row_of] > 0  # [N] tokens of rows with extras
        rank = np.searchsorted(more_rows, row_of[sel])  # [M] their index among the R rows
        lp[rank, local[sel]] = parent[sel]
        valid[rank, local[sel]] = True
        anc, dep = _closure(lp)  # [R, Q+1, Q+1], [R, Q+1]
        depth[sel] = dep[rank, local[sel]]
    L_more = lengths[more_rows]  # [R]
    view = int((lengths + q).max())
    s2 = int((L_more + q[more_rows]).max()) if r else 1
    if bucket and r:  # each token's own view may reach past the row's last slot
        s2 = _round_up(s2, bucket)
    # Tokens 1.. of the multi-token rows: their cache, then their ancestors among the new tokens.
    slots2 = np.arange(s2)[None, :]  # [1, S2]
    cached = slots2 < L_more[:, None]  # [R, S2]
    mask2 = np.broadcast_to(cached[:, None, :], (r, max(width - 1, 1), s2)).copy()  # [R, Q, S2]
    if r:
        rel = slots2 - L_more[:, None]  # [R, S2] new-token index each slot holds
        inside = (rel >= 0) & (rel < width)
        relc = np.clip(rel, 0, width - 1)
        sees_new = np.take_along_axis(anc[:, 1:, :], np.broadcast_to(relc[:, None, :], (r, width - 1, s2)), axis=2)
        mask2 |= sees_new & inside[:, None, :]
        pad = ~valid[:, 1:]  # [R, Q] padded queries: let them see slot 0 only (their output is dropped)
        mask2[pad] = False
        mask2[..., 0] |= pad
    more_index = np.where(valid[:, 1:], starts[more_rows][:, None] + np.arange(1, width)[None, :],
                          starts[more_rows][:, None]) if r else np.zeros((0, 1), np.int64)
    order, groups = _first_groups(lengths, bucket) if bucket else (None, ())
    s1 = max(g[2] for g in groups) if bucket else int(lengths.max()) + 1
    mask1 = np.arange(s1)[None, :] <= lengths[:, None]  # [B, S1]
    view = max(view, s1, s2 if r else 0)
    positions = lengths[row_of] + depth  # [N]
    layout = _PackedLayout(
        rows=torch.as_tensor(row_of), slots=torch.as_tensor(lengths[row_of] + local),
        first=torch.as_tensor(starts[:-1].copy()), first_mask=torch.as_tensor(mask1)[:, None, None, :],
        more_rows=torch.as_tensor(more_rows), more_index=torch.as_tensor(more_index),
        more_valid=torch.as_tensor(valid[:, 1:] if r else np.zeros((0, 1), bool)),
        more_mask=torch.as_tensor(mask2)[:, None],
        more_spans=tuple(zip(more_rows.tolist(), (L_more + q[more_rows]).tolist())),
        first_order=None if order is None else torch.as_tensor(order), first_groups=groups,
        more_views=_more_views(L_more, n[more_rows], bucket) if bucket else ())
    return PackedInputs(ids=torch.as_tensor(ids)[None], positions=torch.as_tensor(positions)[None], layout=layout,
                        starts=starts, depth=depth, view=view)


def pack_prompts(prompts: list[list[int]], *, bucket: int = 0) -> PackedInputs:
    """The prefill: each row's prompt as a causal chain over an empty cache."""
    lens = np.array([len(p) for p in prompts], np.int64)
    more = np.concatenate([np.asarray(p[1:], np.int64) for p in prompts]) if lens.sum() > len(prompts) else \
        np.zeros(0, np.int64)
    offsets = offsets_of(lens - 1)
    parents = np.concatenate([np.arange(-1, k - 1) for k in lens - 1]) if len(more) else np.zeros(0, np.int64)
    return _pack(first_ids=np.array([p[0] for p in prompts], np.int64), lengths=np.zeros(len(prompts), np.int64),
                more_ids=more, more_offsets=offsets, more_parents=parents, bucket=bucket)


def pack_drafts(*, pending: np.ndarray, lengths: np.ndarray, drafts: DraftBatch, bucket: int = 0) -> PackedInputs:
    """A decoding step: each row's pending token, then its draft nodes (chain or tree)."""
    return _pack(first_ids=pending, lengths=lengths, more_ids=drafts.tokens, more_offsets=drafts.offsets,
                more_parents=drafts.parents, bucket=bucket)
