"""A DraftStore's window as checkpoint content (dasrl.atomic.Checkpoint holds the commit, lock, checksum and
the reading of untrusted files): JSON fields + two arrays, no pickle.

store_state(): the fields (step, steps in the window, config, [age, problem id, weight] per sequence, the
token count) and the arrays (tokens, every sequence end to end; offsets, n + 1 of them). DraftStore.save
commits them as a checkpoint of their own (store.json + store-<hash>.npz); RolloutSession.save nests the
fields under its 'store' field beside its own state, one checkpoint. read_store() validates every field,
then reads the arrays no larger than the fields declare, before a store is built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable

import numpy as np

from dasrl.atomic import Checkpoint
from dasrl.drafter.config import StoreConfig
from dasrl.drafter.suffix import first_bad

FORMAT = "dasrl-store/3"
MAX_STEPS = 2**20
"""Most steps a saved window may hold."""
MAX_TOKENS = 2**31
"""Most tokens a saved window may hold."""


@dataclass(frozen=True)
class SavedStore:
    """What read_store() read and validated."""

    config: StoreConfig
    """The config to build the store with (the caller's, else the saved mode/window/decay)."""
    step: int
    """The store's step counter."""
    num_steps: int
    """Steps in the window (ages run 0..num_steps-1, 0 = the newest)."""
    sequences: list[tuple[int, Hashable, float, np.ndarray]]
    """(age, problem id, weight, tokens [n] int32) of every sequence in the window."""


def store_state(*, step: int, num_steps: int, config: StoreConfig,
                sequences: list[tuple[int, Hashable, float, np.ndarray]]) -> tuple[dict, dict[str, np.ndarray]]:
    offsets = np.zeros(len(sequences) + 1, np.int64)
    np.cumsum([len(s[3]) for s in sequences], out=offsets[1:])
    tokens = np.concatenate([s[3] for s in sequences]).astype(np.int32) if sequences else np.zeros(0, np.int32)
    doc = {"step": step, "num_steps": num_steps, "num_tokens": len(tokens),
           "config": {"mode": config.mode, "window": config.window, "decay": config.decay},
           "sequences": [[age, shard, weight] for age, shard, weight, _ in sequences]}
    return doc, {"tokens": tokens, "offsets": offsets}


def read_store(doc: dict, ckpt: Checkpoint, manifest: dict, config: StoreConfig | None) -> SavedStore:
    """The window whose fields are `doc` and whose arrays are in the data file `manifest` names."""
    bad = ckpt.bad
    saved = doc.get("config")
    if not isinstance(saved, dict):
        raise bad(f"'config' must be an object, got {saved!r}")
    try:
        saved_cfg = StoreConfig(mode=saved.get("mode"), window=saved.get("window"), decay=saved.get("decay"))
    except (ValueError, TypeError) as e:
        raise bad(f"config: {e}") from None
    cfg = config or saved_cfg
    step, num_steps, seqs, total = doc.get("step"), doc.get("num_steps"), doc.get("sequences"), doc.get("num_tokens")
    if not _int(step) or step < 0:
        raise bad(f"'step' must be an int >= 0, got {step!r}")
    limit = min(step, saved_cfg.window or MAX_STEPS, MAX_STEPS)
    if not _int(num_steps) or not 0 <= num_steps <= limit:
        raise bad(f"'num_steps' must be an int in [0, {limit}] (step {step}, window {saved_cfg.window}), "
                  f"got {num_steps!r}")
    if not _int(total) or not 0 <= total <= MAX_TOKENS:
        raise bad(f"'num_tokens' must be an int in [0, {MAX_TOKENS}], got {total!r}")
    if not isinstance(seqs, list):
        raise bad(f"'sequences' must be a list, got {type(seqs).__name__}")
    for i, s in enumerate(seqs):
        if not (isinstance(s, list) and len(s) == 3):
            raise bad(f"sequence {i} must be [age, problem id, weight], got {s!r}")
        age, shard, weight = s
        if not _int(age) or not 0 <= age < num_steps:
            raise bad(f"sequence {i}: age must be an int in [0, {num_steps}), got {age!r}")
        if not (isinstance(shard, (int, str)) and not isinstance(shard, bool)):
            raise bad(f"sequence {i}: problem id must be an int or a str, got {shard!r}")
        if not (isinstance(weight, (int, float)) and not isinstance(weight, bool) and math.isfinite(weight)
                and 0 < weight <= 1e300):
            raise bad(f"sequence {i}: weight must be positive and finite, got {weight!r}")
    arrays = ckpt.arrays(manifest, {"tokens": total, "offsets": len(seqs) + 1})
    tokens, offsets = np.ascontiguousarray(arrays["tokens"]), arrays["offsets"].astype(np.int64)
    if len(offsets) != len(seqs) + 1:
        raise bad(f"{len(seqs)} sequences but {len(offsets)} offsets (expected {len(seqs) + 1})")
    if offsets[0] != 0 or (np.diff(offsets) < 0).any() or offsets[-1] != len(tokens) or len(tokens) != total:
        raise bad(f"offsets must rise from 0 to {total} (the token count) without decreasing")
    pos = first_bad(tokens, cfg.token_limit)
    if pos >= 0:
        raise bad(f"token id {int(tokens[pos])} at position {pos} is outside [0, {cfg.token_limit})")
    tokens = tokens.astype(np.int32, copy=False)
    out = [(int(age), shard, float(w), tokens[offsets[i]:offsets[i + 1]]) for i, (age, shard, w) in enumerate(seqs)]
    return SavedStore(cfg, int(step), int(num_steps), out)


def _int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
