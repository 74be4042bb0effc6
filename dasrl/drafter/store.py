"""DraftStore: the history drafter. Suffix-index shards per problem over a sliding window of RL steps.

Modes (the scope of the history, as in the paper's Figure 6):
  problem          finished rollouts of the same problem in the last `window` steps;
  problem+request  that, plus the live request's own prompt and output and its in-flight siblings of the
                   same problem, indexed token by token as they are verified;
  global           one index over every problem's history and every live request (the ArcticInference /
                   vLLM `suffix` behaviour), for comparison.

Weights: a rollout that finished k steps ago weighs decay**k; live sequences weigh `live_weight`.
"""

from __future__ import annotations

import json
import os
from collections import deque
from pathlib import Path
from dataclasses import dataclass, field
from typing import Hashable, Sequence

import numpy as np

from dasrl.atomic import atomic_write, write_json
from dasrl.drafter.base import Draft, DraftParams, problem_key
from dasrl.drafter.suffix import Cursor, SuffixIndex, as_tokens, propose_batch

MODES = ("problem", "problem+request", "global")

GLOBAL = "__global__"


@dataclass(frozen=True)
class StoreConfig:
    """How the history drafter keeps and uses its history."""

    mode: str = "problem+request"
    """History scope: problem | problem+request | global."""
    window: int = 16
    """Training steps of history kept per problem (0 = keep every step)."""
    decay: float = 0.8
    """Weight factor per step of age: a rollout k steps old weighs decay**k."""
    live_weight: float = 1.0
    """Weight of live sequences (the request itself and its in-flight siblings)."""
    params: DraftParams = DraftParams()
    """Match length, minimum path probability and branching of drafts."""
    vocab_size: int | None = None
    """If set, token ids >= vocab_size are refused."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown store mode {self.mode!r}; valid modes: {', '.join(MODES)}")
        if self.window < 0:
            raise ValueError(f"window must be >= 0 (0 = unlimited), got {self.window}")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")
        if not self.live_weight > 0:
            raise ValueError(f"live_weight must be > 0, got {self.live_weight}")


@dataclass
class _Live:
    shard: Hashable
    cursor: Cursor
    prompt: np.ndarray
    output: list[int] = field(default_factory=list)
    seq_id: int | None = None
    """Its sequence in the shard while live (problem+request and global modes)."""
    finished: bool = False


class DraftStore:
    """Implements the Drafter protocol; see the module docstring."""

    def __init__(self, config: StoreConfig = StoreConfig()) -> None:
        self.config = config
        self._shards: dict[Hashable, SuffixIndex] = {}
        self._steps: deque[list[tuple[Hashable, int]]] = deque()  # finished steps: (shard, seq id)
        self._current: list[tuple[Hashable, int]] = []  # this step's finished rollouts, already indexed
        self._pending: list[tuple[Hashable, np.ndarray]] = []  # "problem" mode: indexed at end_step
        self._live: dict[Hashable, _Live] = {}
        self._next_seq = 0
        self.step = 0

    # ------------------------------------------------------------------ helpers
    @property
    def indexes_live(self) -> bool:
        return self.config.mode != "problem"

    def _shard_key(self, problem_id: Hashable | None, prompt: np.ndarray) -> Hashable:
        if self.config.mode == "global":
            return GLOBAL
        return problem_key(prompt) if problem_id is None else problem_id

    def _shard(self, key: Hashable) -> SuffixIndex:
        if key not in self._shards:
            self._shards[key] = SuffixIndex()
        return self._shards[key]

    def _tokens(self, tokens: Sequence[int] | np.ndarray, what: str) -> np.ndarray:
        arr = as_tokens(tokens, what=what)
        vs = self.config.vocab_size
        if vs is not None and arr.size and int(arr.max()) >= vs:
            raise ValueError(f"{what}: token id {int(arr.max())} at position {int(np.argmax(arr))} is outside "
                             f"the vocabulary (size {vs})")
        return arr

    def _index(self, shard: Hashable, tokens: np.ndarray, weight: float) -> int:
        sid = self._next_seq
        self._next_seq += 1
        self._shard(shard).add(sid, tokens, weight)
        return sid

    def _request(self, req_id: Hashable) -> _Live:
        try:
            return self._live[req_id]
        except KeyError:
            raise KeyError(f"unknown request id {req_id!r}") from None

    # ----------------------------------------------------------------- protocol
    def start(self, req_id: Hashable, problem_id: Hashable | None, prompt_ids: Sequence[int]) -> None:
        if req_id in self._live:
            raise KeyError(f"request {req_id!r} already started")
        prompt = self._tokens(prompt_ids, "prompt_ids")
        if prompt.size == 0:
            raise ValueError(f"empty prompt for request {req_id!r}")
        shard = self._shard_key(problem_id, prompt)
        live = _Live(shard, self._shard(shard).cursor(self.config.params.max_match), prompt)
        live.cursor.extend(prompt)
        if self.indexes_live:
            live.seq_id = self._index(shard, prompt, self.config.live_weight)
        self._live[req_id] = live

    def propose(self, req_ids: Sequence[Hashable], budgets: Sequence[int]) -> list[Draft]:
        try:
            cursors = [self._live[r].cursor for r in req_ids]
        except KeyError:
            cursors = [self._request(r).cursor for r in req_ids]  # raises, naming the unknown id
        p = self.config.params
        return propose_batch(cursors, budgets, min_prob=p.min_prob, branching=p.branching)

    def observe(self, req_id: Hashable, tokens: Sequence[int]) -> None:
        live = self._request(req_id)
        if live.finished:
            raise ValueError(f"request {req_id!r} is finished; it cannot take more tokens")
        arr = self._tokens(tokens, "tokens")
        live.cursor._c.extend(arr)  # validated once above; the core calls need no second check
        live.output.extend(arr.tolist())
        if live.seq_id is not None:
            self._shards[live.shard]._ix.append(live.seq_id, arr)

    def finish(self, req_id: Hashable) -> None:
        live = self._request(req_id)
        if live.finished:
            raise ValueError(f"request {req_id!r} finished twice")
        live.finished = True
        if live.seq_id is not None:
            self._current.append((live.shard, live.seq_id))
        else:
            self._pending.append((live.shard, np.concatenate([live.prompt, np.asarray(live.output, np.int32)])))
        del self._live[req_id]

    def add_rollout(self, problem_id: Hashable | None, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> None:
        """Feed a finished rollout of this step (indexed at once, whatever the mode)."""
        prompt = self._tokens(prompt_ids, "prompt_ids")
        if prompt.size == 0:
            raise ValueError("empty prompt in add_rollout")
        shard = self._shard_key(problem_id, prompt)
        seq = np.concatenate([prompt, self._tokens(response_ids, "response_ids")])
        self._current.append((shard, self._index(shard, seq, 1.0)))

    def end_step(self) -> None:
        """Fold this step's rollouts into the window, age the weights, evict the oldest step."""
        for req_id in list(self._live):  # requests never finished this step are dropped, not history
            live = self._live.pop(req_id)
            if live.seq_id is not None:
                self._shards[live.shard].remove(live.seq_id)
        for shard, seq in self._pending:
            self._current.append((shard, self._index(shard, seq, 1.0)))
        self._pending = []
        for ix in self._shards.values():
            ix.scale_weights(self.config.decay)
        self._steps.append(self._current)
        self._current = []
        while self.config.window and len(self._steps) > self.config.window:
            for shard, sid in self._steps.popleft():
                ix = self._shards[shard]
                ix.remove(sid)
                if len(ix) == 0:
                    del self._shards[shard]
        self.step += 1

    def discard_step(self) -> None:
        """End the step without learning from it: this step's rollouts (finished or not) are dropped, the
        window, weights and step counter stay as they were. A store fed with some steps and then only
        discarding is a static drafter: a fixed index of those steps."""
        for req_id in list(self._live):
            live = self._live.pop(req_id)
            if live.seq_id is not None:
                self._shards[live.shard].remove(live.seq_id)
        for shard, sid in self._current:
            ix = self._shards[shard]
            ix.remove(sid)
            if len(ix) == 0:
                del self._shards[shard]
        self._current, self._pending = [], []

    # -------------------------------------------------------------- persistence
    def save(self, folder: str | os.PathLike) -> None:
        """Write the window (JSON + npz, no pickle) atomically into `folder`; live requests are not saved."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        meta, tokens, offsets = [], [], [0]
        for age, step in enumerate(reversed(self._steps)):
            for shard, sid in step:
                if not isinstance(shard, (int, str)) or isinstance(shard, bool):
                    raise TypeError(f"problem id {shard!r} cannot be saved: use int or str problem ids")
                ix = self._shards[shard]
                toks = ix.tokens(sid)
                tokens.append(toks)
                offsets.append(offsets[-1] + len(toks))
                meta.append([age, shard, ix.weight(sid)])
        arrays = {"tokens": np.concatenate(tokens) if tokens else np.zeros(0, np.int32),
                  "offsets": np.asarray(offsets, dtype=np.int64)}
        doc = {"format": "dasrl-store/1", "step": self.step, "num_steps": len(self._steps),
               "config": {"mode": self.config.mode, "window": self.config.window, "decay": self.config.decay},
               "sequences": meta}
        atomic_write(folder / "store.npz", lambda f: np.savez(f, **arrays))
        write_json(folder / "store.json", doc, indent=None)

    @classmethod
    def load(cls, folder: str | os.PathLike, config: StoreConfig | None = None) -> "DraftStore":
        folder = Path(folder)
        try:
            doc = json.loads((folder / "store.json").read_text())
            with np.load(folder / "store.npz", allow_pickle=False) as z:
                tokens, offsets = z["tokens"], z["offsets"]
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"cannot read a draft store from {folder}: {e}") from None
        if doc.get("format") != "dasrl-store/1":
            raise ValueError(f"{folder / 'store.json'}: not a dasrl store (format {doc.get('format')!r})")
        saved = doc["config"]
        store = cls(config or StoreConfig(mode=saved["mode"], window=saved["window"], decay=saved["decay"]))
        steps: list[list[tuple[Hashable, int]]] = [[] for _ in range(doc["num_steps"])]
        for i, (age, shard, weight) in enumerate(doc["sequences"]):
            seq = tokens[offsets[i]: offsets[i + 1]]
            steps[len(steps) - 1 - age].append((shard, store._index(shard, seq, weight)))
        store._steps = deque(steps)
        store.step = int(doc["step"])
        return store

    # -------------------------------------------------------------------- stats
    def bytes_used(self) -> int:
        return sum(ix.bytes_used() for ix in self._shards.values())

    @property
    def num_tokens(self) -> int:
        return sum(ix.num_tokens for ix in self._shards.values())

    @property
    def num_shards(self) -> int:
        return len(self._shards)

    def check_integrity(self) -> None:
        for ix in self._shards.values():
            ix.check_integrity()
