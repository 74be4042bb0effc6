"""DraftStore: the history drafter. Suffix-index shards per problem over a sliding window of RL steps.

Modes (the paper's Figure 6): problem (finished rollouts of the problem in the window), problem+request
(also the live request and its in-flight siblings, indexed as they are verified), global (one index for
everything, as vLLM's `suffix`). With cross_problem, one more index of every problem's window (and live
requests) is a second source of each cursor, so a problem's first visit drafts from the others'.
A rollout k steps old weighs decay**k. A shard exists while it holds a sequence or a live request uses it.
Input is validated once, at the protocol boundary; behind it the native calls run unchecked.
docs/drafter.md ("The store", "Every source, scored", "Persistence") tells the why of each.
"""

from __future__ import annotations

import math
import os
from collections import Counter, deque
from dataclasses import dataclass
from itertools import chain
from typing import Hashable, Sequence

import numpy as np

from dasrl import _core
from dasrl.atomic import Checkpoint
from dasrl.drafter.base import (TOKEN_LIMIT, Draft, DraftBatch, DraftParams, _is_int, budget_array, offsets_of,
                                problem_key)
from dasrl.drafter.suffix import (Cursor, SuffixIndex, _as_tokens, best_continuation_batch, first_bad, token_array,
                                  token_error)

MODES = ("problem", "problem+request", "global")


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
    """Weight of live sequences (the request itself and its in-flight siblings), in [1e-100, 1e100]."""
    cross_problem: bool = True
    """Also draft from one index of every problem's finished rollouts in the window (evicted with it); the
    draft with the higher expected accepted length wins, so a problem's first visit drafts from the others'."""
    params: DraftParams = DraftParams()
    """Match length, minimum path probability and branching of drafts."""
    vocab_size: int | None = None
    """If set, token ids >= vocab_size are refused."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown store mode {self.mode!r}; valid modes: {', '.join(MODES)}")
        if not _is_int(self.window) or not 0 <= self.window < 2**31:
            raise ValueError(f"window must be an int >= 0 (0 = unlimited), got {self.window!r}")
        if not (_is_real(self.decay) and 0.0 < self.decay <= 1.0):
            raise ValueError(f"decay must be in (0, 1], got {self.decay!r}")
        # Bounded so that live_weight * decay**age stays a normal double until the step is evicted
        # (_MIN_STEP_WEIGHT): the weights of a draft's ratios never underflow to 0.
        if not (_is_real(self.live_weight) and 1e-100 <= self.live_weight <= 1e100):
            raise ValueError(f"live_weight must be in [1e-100, 1e100], got {self.live_weight!r}")
        if not isinstance(self.cross_problem, bool):
            raise ValueError(f"cross_problem must be a bool, got {self.cross_problem!r}")
        if not isinstance(self.params, DraftParams):
            raise ValueError(f"params must be a DraftParams, got {self.params!r}")
        if self.vocab_size is not None and (not _is_int(self.vocab_size) or not 1 <= self.vocab_size <= TOKEN_LIMIT):
            raise ValueError(f"vocab_size must be None or an int in [1, 2^31], got {self.vocab_size!r}")

    @property
    def token_limit(self) -> int:
        """Token ids must be below this."""
        return TOKEN_LIMIT if self.vocab_size is None else self.vocab_size


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool) and math.isfinite(x)


_GLOBAL = "__global__"
_CROSS = object()  # the cross-problem index's key in the window's bookkeeping (never a problem id)
_MIN_STEP_WEIGHT = 1e-200
"""A finished step whose decay**age is below this is evicted whatever `window` says: its weight would
underflow to 0.0 (NaN probabilities). With live_weight in [1e-100, 1e100] every weight stays normal."""
_EMPTY = np.zeros(0, np.int32)
_FORMAT = "dasrl-store/3"
_MAX_STEPS = 2**20  # most steps a saved window may hold
_MAX_TOKENS = 2**31  # most tokens a saved window may hold


@dataclass(eq=False)
class _Live:
    shard: Hashable
    cursor: Cursor  # prompt + output; in problem+request and global modes it also grows seq_id in the shard
    prompt_len: int
    seq_id: int | None = None  # its live sequence in the shard (problem+request and global modes)
    cross_id: int | None = None  # its live sequence in the cross-problem index (problem+request mode)

    @property
    def output(self) -> list[int]:
        return self.cursor.context()[self.prompt_len:].tolist()


class DraftStore:
    """Implements the Drafter protocol (and its flat batch paths); see the module docstring."""

    def __init__(self, config: StoreConfig = StoreConfig()) -> None:
        if not isinstance(config, StoreConfig):
            raise TypeError(f"config must be a StoreConfig, got {type(config).__name__}")
        self.config = config
        self._limit = config.token_limit
        self._shards: dict[Hashable, SuffixIndex] = {}
        self._cross: SuffixIndex | None = SuffixIndex() if config.cross_problem and config.mode != "global" else None
        self._users: dict[Hashable, int] = {}  # live requests per shard
        self._steps: deque[list[tuple[Hashable, int]]] = deque()  # finished steps: (shard or _CROSS, seq id)
        self._current: list[tuple[Hashable, int]] = []  # this step's finished rollouts, already indexed
        self._pending: list[tuple[Hashable, np.ndarray]] = []  # "problem" mode: indexed at end_step
        self._live: dict[Hashable, _Live] = {}
        self._native: dict[Hashable, object] = {}  # req -> its cursor's native handle (the batch calls' fast path)
        self._batch: tuple[list, list] | None = None  # the last batch call's (ids, handles) until one comes or goes
        self._done: set[Hashable] = set()  # requests finished or aborted this step (for clear errors)
        self._next_seq = 0
        self.step = 0
        self._closed = False

    def close(self) -> None:
        """Free the native indexes now rather than at garbage collection (a session's close(), the end of a
        `with` block). The store is empty after, and refuses new requests and rollouts. Idempotent."""
        for part in (self._shards, self._users, self._steps, self._current, self._pending, self._live, self._native):
            part.clear()
        self._cross = self._batch = None
        self._closed = True

    def __enter__(self) -> "DraftStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("this DraftStore is closed (close() freed its history)")

    # ------------------------------------------------------------------ helpers
    def _prompt(self, problem_id: Hashable | None, prompt_ids: Sequence[int], empty: str
                ) -> tuple[Hashable, np.ndarray]:
        """(shard key, [n] int32 tokens) of a prompt, checked; `empty`: the error of an empty one."""
        prompt = _as_tokens(prompt_ids, what="prompt_ids", vocab_size=self.config.vocab_size)
        if prompt.size == 0:
            raise ValueError(empty)
        hash(problem_id)  # an unhashable id fails here, before anything changes
        if self.config.mode == "global":
            return _GLOBAL, prompt
        return (problem_key(prompt) if problem_id is None else problem_id), prompt

    def _shard(self, key: Hashable) -> SuffixIndex:
        """The shard of `key`, created on first use (by then every check has passed)."""
        if key not in self._shards:
            self._shards[key] = SuffixIndex()
        return self._shards[key]

    def _add(self, ix: SuffixIndex, tokens: np.ndarray, weight: float) -> int:
        """Index valid tokens as a new sequence of `ix`; its id."""
        sid = self._next_seq
        self._next_seq += 1
        ix.add_unchecked(sid, tokens, weight)
        return sid

    def _fold(self, shard: Hashable, seq: np.ndarray, weight: float) -> None:
        """A finished rollout (valid tokens) joins its shard and the cross-problem index, in this step's window."""
        self._current.append((shard, self._add(self._shard(shard), seq, weight)))
        if self._cross is not None:
            self._current.append((_CROSS, self._add(self._cross, seq, weight)))

    def _drop(self, shard: Hashable, sid: int | None = None, *, user: bool = False) -> None:
        """Remove a sequence and/or a user of a shard; the shard goes when its last of both goes."""
        if shard is _CROSS:
            self._cross.remove(sid)
            return
        ix = self._shards[shard]
        if sid is not None:
            ix.remove(sid)
        if user:
            self._users[shard] -= 1
            if not self._users[shard]:
                del self._users[shard]
        if len(ix) == 0 and shard not in self._users:
            del self._shards[shard]

    def _request(self, req_id: Hashable) -> _Live:
        live = self._live.get(req_id)
        if live is None:
            self._check_open()
            if req_id in self._done:
                raise ValueError(f"request {req_id!r} is finished; it cannot take more calls this step")
            raise KeyError(f"unknown request id {req_id!r}")
        return live

    def _cursors(self, req_ids: Sequence[Hashable]) -> list:
        """The native cursors of these live requests (what the native batch calls take)."""
        last = self._batch
        if last is not None and type(req_ids) is list and last[0] == req_ids:  # vLLM: the same rows step after step
            return last[1]
        try:
            cursors = [self._native[r] for r in req_ids]
        except (KeyError, TypeError):
            return [self._request(r).cursor.native for r in req_ids]  # raises, naming the request
        self._batch = (list(req_ids), cursors)
        return cursors

    def _retire(self, req_id: Hashable) -> _Live:
        """Take a live request out of the batch (finished or aborted: it takes no more calls this step)."""
        del self._native[req_id]
        self._batch = None
        self._done.add(req_id)
        return self._live.pop(req_id)

    def _forget(self, live: _Live) -> None:
        """Drop a request's live sequences and its use of its shard: nothing of it is learnt."""
        self._drop(live.shard, live.seq_id, user=True)
        if live.cross_id is not None:
            self._cross.remove(live.cross_id)

    # ----------------------------------------------------------------- protocol
    def start(self, req_id: Hashable, problem_id: Hashable | None, prompt_ids: Sequence[int]) -> None:
        self._check_open()
        if req_id in self._live:
            raise KeyError(f"request {req_id!r} already started")
        shard, prompt = self._prompt(problem_id, prompt_ids, f"empty prompt for request {req_id!r}")
        # Everything is checked: from here on nothing can fail.
        ix, live_indexed, weight = self._shard(shard), self.config.mode != "problem", self.config.live_weight
        seq_id = self._add(ix, _EMPTY, weight) if live_indexed else None
        self._users[shard] = self._users.get(shard, 0) + 1
        self._done.discard(req_id)  # an id may be reused once its request is finished
        cursor = ix.cursor(self.config.params.max_match, seq_id)
        cross_id = None
        if self._cross is not None:
            cross_id = self._add(self._cross, _EMPTY, weight) if live_indexed else None
            cursor.add_source(self._cross, cross_id)
        cursor.feed(prompt)  # the context and, when live-indexed, the live sequences
        self._live[req_id] = _Live(shard, cursor, len(prompt), seq_id, cross_id)
        self._native[req_id] = cursor.native
        self._batch = None

    def propose(self, req_ids: Sequence[Hashable], budgets: Sequence[int]) -> list[Draft]:
        return self.propose_flat(req_ids, budgets).drafts()

    def propose_flat(self, req_ids: Sequence[Hashable], budgets: Sequence[int] | np.ndarray) -> DraftBatch:
        """The whole batch's drafts in one native call, as flat arrays (see DraftBatch)."""
        self._check_open()
        cursors = self._cursors(req_ids)
        p = self.config.params
        return DraftBatch(*_core.propose_batch(cursors, budget_array(req_ids, budgets), p.min_prob, p.branching))

    def best_continuation(self, req_ids: Sequence[Hashable], targets: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """suffix.best_continuation_batch over these requests' cursors (the lab's oracle bound)."""
        cursors = [self._request(r).cursor for r in req_ids]
        return best_continuation_batch(cursors, targets, np.asarray(offsets, np.int64))

    def observe(self, req_id: Hashable, tokens: Sequence[int] | np.ndarray) -> None:
        live = self._request(req_id)
        if type(tokens) is not np.ndarray:
            tokens = token_array(tokens)
        try:
            bad = live.cursor.feed(tokens, self._limit)
        except TypeError:  # not a 1-D contiguous integer array: the wrapper names what is wrong
            bad = live.cursor.feed(token_array(tokens), self._limit)
        if bad >= 0:
            raise token_error(tokens, bad, vocab_size=self.config.vocab_size)

    def observe_batch(self, req_ids: Sequence[Hashable], token_lists: Sequence[Sequence[int] | np.ndarray]) -> None:
        """observe() for many requests in one native call; all or nothing (a bad token changes nothing)."""
        if len(req_ids) != len(token_lists):
            raise ValueError(f"{len(req_ids)} request ids but {len(token_lists)} token lists")
        self.observe_flat(req_ids, *_flatten(token_lists))

    def observe_flat(self, req_ids: Sequence[Hashable], tokens: np.ndarray, offsets: np.ndarray) -> None:
        """observe_batch of request i's tokens[offsets[i]:offsets[i+1]] (offsets: [n+1] int64)."""
        cursors = self._cursors(req_ids)
        bad = _core.extend_batch(cursors, tokens, offsets, self._limit) if cursors else -1
        if bad >= 0:
            i = int(np.searchsorted(offsets, bad, side="right")) - 1
            raise token_error(tokens[offsets[i]:offsets[i + 1]], bad - int(offsets[i]),
                              what=f"tokens of request {req_ids[i]!r}", vocab_size=self.config.vocab_size, row=i)

    def observe_rows(self, req_ids: Sequence[Hashable], token_rows: np.ndarray, rows: np.ndarray, start: np.ndarray,
                     count: np.ndarray) -> None:
        """observe_batch of request i's token_rows[rows[i], start[i]:start[i] + count[i]] (a 2-D integer array,
        e.g. vLLM's token buffer), read in place by one native call; a bad token's TokenError has `row` = i."""
        cursors = self._cursors(req_ids)
        if not cursors:
            return
        try:  # (-1, -1), or (i, offset) of the first bad token (a negative one anywhere first) and nothing changed
            i, j = _core.extend_rows(cursors, token_rows, rows, start, count, self._limit)
        except TypeError:  # not a C-contiguous int32/int64 table: gathered here, then the flat call
            offsets = offsets_of(count)
            at = np.repeat(rows, count)
            cols = np.arange(int(offsets[-1])) + np.repeat(start - offsets[:-1], count)
            self.observe_flat(req_ids, np.asarray(np.asarray(token_rows)[at, cols]), offsets)
            return
        if i >= 0:
            toks = np.asarray(token_rows[rows[i], start[i]:start[i] + count[i]])
            raise token_error(toks, j, what=f"tokens of request {req_ids[i]!r}", vocab_size=self.config.vocab_size,
                              row=i)

    def finish(self, req_id: Hashable) -> None:
        live = self._live.get(req_id)
        if live is None:
            if req_id in self._done:
                raise ValueError(f"request {req_id!r} finished twice (or finished after abort)")
            raise KeyError(f"unknown request id {req_id!r}")
        self._retire(req_id)
        if live.seq_id is not None:
            self._current.append((live.shard, live.seq_id))
            if live.cross_id is not None:
                self._current.append((_CROSS, live.cross_id))
        else:
            self._pending.append((live.shard, live.cursor.context()))
        self._drop(live.shard, user=True)

    def abort(self, req_id: Hashable) -> None:
        """Drop a live request without learning from it (a crashed or cancelled generation)."""
        self._request(req_id)
        self._forget(self._retire(req_id))

    def add_rollout(self, problem_id: Hashable | None, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> None:
        """Feed a finished rollout of this step (indexed at once, whatever the mode)."""
        self._check_open()
        shard, prompt = self._prompt(problem_id, prompt_ids, "empty prompt in add_rollout")
        response = _as_tokens(response_ids, what="response_ids", vocab_size=self.config.vocab_size)
        self._fold(shard, np.concatenate([prompt, response]), 1.0)

    def _drop_unfinished(self) -> None:
        for live in self._live.values():  # requests never finished this step are dropped, not history
            self._forget(live)
        for part in (self._live, self._native, self._done):
            part.clear()
        self._batch = None

    def end_step(self) -> None:
        """Fold this step's rollouts into the window, age the weights, evict the oldest step."""
        self._check_open()
        self._drop_unfinished()
        for shard, seq in self._pending:
            self._fold(shard, seq, 1.0)
        self._pending = []
        for ix in self._indexes():
            ix.scale_weights(self.config.decay)
        self._steps.append(self._current)
        self._current = []
        window, decay = self.config.window, self.config.decay
        while self._steps and ((window and len(self._steps) > window)
                               or decay ** len(self._steps) < _MIN_STEP_WEIGHT):  # the oldest's weight
            for shard, sid in self._steps.popleft():
                self._drop(shard, sid)
        self.step += 1

    def discard_step(self) -> None:
        """End the step without learning from it: this step's rollouts (finished or not) are dropped, the
        window, weights and step counter stay as they were. A store fed with some steps and then only
        discarding is a static drafter: a fixed index of those steps."""
        self._check_open()
        self._drop_unfinished()
        for shard, sid in self._current:
            self._drop(shard, sid)
        self._current, self._pending = [], []

    # -------------------------------------------------------------- persistence
    def save(self, folder: str | os.PathLike) -> None:
        """Write the window into `folder` (dasrl.atomic.Checkpoint); live requests and this step's rollouts are
        not saved."""
        doc, arrays = self.state()
        Checkpoint(folder, "store", "draft store").save({"format": _FORMAT, **doc}, arrays)

    def state(self) -> tuple[dict, dict[str, np.ndarray]]:
        """The window as checkpoint content: JSON fields ([age, problem id, weight] per sequence...) and
        arrays (tokens end to end, n + 1 offsets); RolloutSession.save nests the fields in its own."""
        self._check_open()  # a closed store is empty: its save would overwrite a good one
        seqs, toks = [], []
        for age, step in enumerate(reversed(self._steps)):
            for shard, sid in step:
                if shard is _CROSS:
                    continue  # a copy of a shard's sequence: load() makes it again
                if not isinstance(shard, (int, str)) or isinstance(shard, bool):
                    raise TypeError(f"problem id {shard!r} cannot be saved: use int or str problem ids")
                ix = self._shards[shard]
                seqs.append([age, shard, ix.weight(sid)])
                toks.append(ix.tokens(sid))
        offsets = offsets_of([len(t) for t in toks])
        c = self.config
        doc = {"step": self.step, "num_steps": len(self._steps), "num_tokens": int(offsets[-1]),
               "config": {"mode": c.mode, "window": c.window, "decay": c.decay}, "sequences": seqs}
        return doc, {"tokens": np.concatenate(toks).astype(np.int32) if toks else np.zeros(0, np.int32),
                     "offsets": offsets}

    @classmethod
    def load(cls, folder: str | os.PathLike, config: StoreConfig | None = None) -> "DraftStore":
        """Read what save() wrote; every field is validated before anything is built (one ValueError)."""
        if config is not None and not isinstance(config, StoreConfig):
            raise TypeError(f"config must be a StoreConfig or None, got {config!r} ({type(config).__name__})")
        ckpt = Checkpoint(folder, "store", "draft store")
        with ckpt.reading(_FORMAT) as doc:
            return cls.from_state(doc, ckpt, doc, config)

    @classmethod
    def from_state(cls, doc: dict, ckpt: Checkpoint, manifest: dict, config: StoreConfig | None) -> "DraftStore":
        """The store of state()'s fields `doc` and the arrays `manifest` names: every field validated, then the
        arrays read no larger than the fields declare."""
        bad = ckpt.bad
        saved = doc.get("config")
        if not isinstance(saved, dict):
            raise bad(f"'config' must be an object, got {saved!r}")
        try:
            saved_cfg = StoreConfig(mode=saved.get("mode"), window=saved.get("window"), decay=saved.get("decay"))
        except (ValueError, TypeError) as e:
            raise bad(f"config: {e}") from None
        cfg = config or saved_cfg
        step, num_steps, seqs, total = (doc.get(k) for k in ("step", "num_steps", "sequences", "num_tokens"))
        if not _is_int(step) or step < 0:
            raise bad(f"'step' must be an int >= 0, got {step!r}")
        limit = min(step, saved_cfg.window or _MAX_STEPS, _MAX_STEPS)
        if not _is_int(num_steps) or not 0 <= num_steps <= limit:
            raise bad(f"'num_steps' must be an int in [0, {limit}] (step {step}, window {saved_cfg.window}), "
                      f"got {num_steps!r}")
        if not _is_int(total) or not 0 <= total <= _MAX_TOKENS:
            raise bad(f"'num_tokens' must be an int in [0, {_MAX_TOKENS}], got {total!r}")
        if not isinstance(seqs, list):
            raise bad(f"'sequences' must be a list, got {type(seqs).__name__}")
        for i, s in enumerate(seqs):
            if not (isinstance(s, list) and len(s) == 3):
                raise bad(f"sequence {i} must be [age, problem id, weight], got {s!r}")
            age, shard, weight = s
            if not _is_int(age) or not 0 <= age < num_steps:
                raise bad(f"sequence {i}: age must be an int in [0, {num_steps}), got {age!r}")
            if not (isinstance(shard, (int, str)) and not isinstance(shard, bool)):
                raise bad(f"sequence {i}: problem id must be an int or a str, got {shard!r}")
            if not (_is_real(weight) and 0 < weight <= 1e300):
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
        store = cls(cfg)
        steps: list[list[tuple[Hashable, int]]] = [[] for _ in range(num_steps)]
        for i, (age, shard, weight) in enumerate(seqs):
            store._current = steps[num_steps - 1 - age]
            store._fold(shard, tokens[offsets[i]:offsets[i + 1]], float(weight))
        store._current = []
        store._steps = deque(steps)
        store.step = step
        return store

    # -------------------------------------------------------------------- stats
    def _indexes(self) -> list[SuffixIndex]:
        self._check_open()
        return list(self._shards.values()) + ([self._cross] if self._cross is not None else [])

    def bytes_used(self) -> int:
        return sum(ix.bytes_used() for ix in self._indexes())

    @property
    def num_tokens(self) -> int:
        """Tokens of the window and the live requests, once (bytes_used counts the cross-problem copies)."""
        self._check_open()
        return sum(ix.num_tokens for ix in self._shards.values())

    @property
    def num_shards(self) -> int:
        self._check_open()
        return len(self._shards)

    @property
    def num_live(self) -> int:
        self._check_open()
        return len(self._live)

    def check_integrity(self) -> None:
        """Every shard's index, and the store's own bookkeeping (no empty shard without a user)."""
        self._check_open()
        for key, ix in self._shards.items():
            ix.check_integrity()
            if len(ix) == 0 and key not in self._users:
                raise AssertionError(f"shard {key!r} is empty and unused")
        users = Counter(live.shard for live in self._live.values())
        if users != self._users:
            raise AssertionError(f"shard users {self._users} do not match the live requests {dict(users)}")
        cross = 0
        for live in self._live.values():
            if live.seq_id is not None and live.seq_id not in self._shards[live.shard]:
                raise AssertionError(f"live sequence {live.seq_id} missing from shard {live.shard!r}")
            if live.cross_id is not None:
                cross += 1
                if live.cross_id not in self._cross:
                    raise AssertionError(f"live sequence {live.cross_id} missing from the cross-problem index")
        for shard, sid in chain(chain.from_iterable(self._steps), self._current):
            if shard is _CROSS:
                cross += 1
                if self._cross is None or sid not in self._cross:
                    raise AssertionError(f"sequence {sid} of the window missing from the cross-problem index")
            elif sid not in self._shards[shard]:
                raise AssertionError(f"sequence {sid} of the window missing from shard {shard!r}")
        if self._cross is not None:
            self._cross.check_integrity()
            if len(self._cross) != cross:  # nothing outside the window: it evicts with the window
                raise AssertionError(f"cross-problem index holds {len(self._cross)} sequences, the window and "
                                     f"the live requests {cross}")


def _flatten(token_lists: Sequence[Sequence[int] | np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [total] integer array, offsets [n+1] int64) of many token lists, types checked."""
    offsets = offsets_of([len(t) for t in token_lists])
    if not token_lists:
        return np.zeros(0, np.int32), offsets
    if all(type(t) is list for t in token_lists):
        flat = list(chain.from_iterable(token_lists))
        if all(type(t) is int for t in flat):
            try:
                return (np.array(flat, dtype=np.int64) if flat else np.zeros(0, np.int32)), offsets
            except OverflowError:
                pass  # the per-list path below names the value
    arrays = [token_array(t, what=f"tokens[{i}]") for i, t in enumerate(token_lists)]
    return np.concatenate(arrays) if arrays else np.zeros(0, np.int32), offsets
