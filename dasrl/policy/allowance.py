"""The session's speculation policy (`make_policy("das")`): each row's draft priced so that drafting never costs
more than it saves, the fixed cost of a forward carried where the makespan is (docs/policy.md "Never slower").

A row drafting d tokens at per-token acceptance p emits E(d, p) = 1 + p + ... + p^d tokens per forward and
drafts the d with the fewest seconds per emitted token (`_priced`); the m rows predicted to make the critical
path carry c_base / m and c_draft / m, every other row c_base / B and the whole c_draft. The per-row state lives
in arrays (a slot per request) and the split and the trim run in the native core (dasrl/_core price_split,
cut_chains: numpy's arithmetic, in numpy's order), so a step costs no Python per row.
tests/test_policy_rows.py holds it to the row-by-row policy it replaced.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, fields
from typing import Hashable, Sequence

import numpy as np

from dasrl import _core
from dasrl.drafter.base import DraftBatch
from dasrl.policy.acceptance import AcceptanceRate, _Slots
from dasrl.policy.base import RequestState
from dasrl.policy.latency import LatencyModel
from dasrl.policy.length import LengthClassifier, LengthConfig


_MAX_PRICED = 256
"""Longest draft priced (the engine's widest draft is far below; p near 1 would otherwise price 1024)."""
_CALIB_PRIOR = 4.0
"""Pseudo-tokens holding the path-probability calibration at 1 until drafts are verified."""
_CLASS_NAMES = ("none", "short", "medium", "long")
"""The length classes spending is logged under (a row's class is kept as an index into this tuple)."""
_CLASS_CODE = {c: i for i, c in enumerate(_CLASS_NAMES)}
_NONE = np.zeros(0)
_LENGTHS: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def _unit(p: np.ndarray) -> np.ndarray:
    """np.clip(p, 0, 1) (the same values), without clip's overhead."""
    return np.minimum(np.maximum(p, 0.0), 1.0)


def _lengths(n: int) -> tuple[np.ndarray, np.ndarray]:
    """(arange(n), [1, n] the lengths + 1 as float64), kept per n (read only)."""
    out = _LENGTHS.get(n)
    if out is None:
        d = np.arange(n)
        out = _LENGTHS[n] = (d, (d.astype(np.float64) + 1)[None, :])
        for a in out:
            a.flags.writeable = False
    return out


def _tokens_per_forward(k, p, k1: np.ndarray | None = None) -> np.ndarray:
    """Expected tokens a row emits per forward drafting a chain of k at per-token acceptance p: 1 + p + ... + p^k
    (the accepted prefix plus the recovered or bonus token). k1: k + 1 as float64, when at hand."""
    k, p = np.asarray(k, np.float64), _unit(np.asarray(p, np.float64))
    one = p >= 1.0
    if not one.any():  # the usual case: the formula alone
        return (1.0 - p ** (k + 1 if k1 is None else k1)) / (1.0 - p)
    geo = (1.0 - p ** (k + 1)) / np.where(one, 1.0, 1.0 - p)  # p = 1 is taken below (no 0 / 0 to silence)
    return np.where(one, k + 1, geo)


def _pace_draft(remaining, p, *, horizon: float, most) -> np.ndarray:
    """Per row, the shortest draft (at most `most`) with which its `remaining` tokens take no more than
    `horizon` forwards: a row that finishes within the critical path anyway drafts nothing."""
    remaining, most = np.asarray(remaining, np.float64), np.asarray(most, np.int64)
    p = _unit(np.asarray(p, np.float64))
    need = remaining / max(horizon, 1e-9)  # [B] tokens per forward the row must make
    out = np.zeros(len(need), np.int64)
    at = np.flatnonzero((need > 1.0) & (most > 0))  # every other row drafts nothing
    for i, n, q, m in zip(at.tolist(), need[at].tolist(), p[at].tolist(), most[at].tolist()):
        if q >= 1.0:
            k = math.ceil(n - 1.0)
        elif 1.0 - (1.0 - q) * n <= 0.0 or q <= 0.0:
            k = m  # out of reach: its best
        else:  # 1 + q + ... + q^k >= n  <=>  q^(k+1) <= 1 - (1 - q) n
            k = math.ceil(math.log(1.0 - (1.0 - q) * n) / math.log(q) - 1.0 - 1e-9)
        out[i] = min(max(k, 0), m)
    return out


@dataclass(frozen=True)
class ClassCaps:
    """Draft cap per length class. The pricing decides what a row drafts below its cap, so the caps are equal
    by default (the paper's 0 / 4 / 24 against equal caps: docs/whatif.md)."""

    short: int = 24
    """Cap of requests predicted short."""
    medium: int = 24
    """Cap of requests predicted medium."""
    long: int = 24
    """Cap of requests predicted long."""

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(f"cap for class {f.name!r} must be >= 0, got {getattr(self, f.name)}")

    def uniform(self) -> int | None:
        """The cap every row gets whatever its class (equal caps), else None."""
        return int(self.long) if self.short == self.medium == self.long else None


@dataclass
class RowBatch:
    """The live rows of one step as arrays: what `budgets` reads of each RequestState."""

    keys: Sequence[Hashable]
    """Each row's request key (RequestState.req_id)."""
    problems: Sequence[Hashable]
    """Each row's problem (RequestState.problem_id)."""
    prompt_len: np.ndarray
    """[B] int64, and the same for the four below."""
    max_new_tokens: np.ndarray
    generated: np.ndarray
    drafted: np.ndarray
    accepted: np.ndarray

    def __len__(self) -> int:
        return len(self.keys)

    @staticmethod
    def of(states: Sequence[RequestState]) -> "RowBatch":
        def col(name: str) -> np.ndarray:
            return np.fromiter((getattr(s, name) for s in states), np.int64, len(states))

        return RowBatch([s.req_id for s in states], [s.problem_id for s in states], col("prompt_len"),
                        col("max_new_tokens"), col("generated"), col("drafted"), col("accepted"))


class _RowSlots(_Slots):
    """Per request: the drafted and accepted counts last folded in, the class it last drafted under (`cls`), and
    two caches while the length history's version stays and the row stays within their span: its expected
    length (`e`, valid up to `e_last` generated tokens) and its length class (`c_code`, up to `c_last`)."""

    makes = True

    def __init__(self) -> None:
        super().__init__(0, drafted=np.int64, accepted=np.int64, cls=np.int32, e=np.float64, e_last=np.int64,
                         e_version=np.int64, c_code=np.int32, c_last=np.int64, c_version=np.int64)

    def add(self, key: Hashable) -> int:
        s = super().add(key)
        self.e_version[s] = self.c_version[s] = -1  # nothing cached
        return s


class ForwardAllowance:
    """The das policy: each row's cap that of its length class, re-estimated every step from its problem's length
    history and its partial length; each row's draft under its cap priced (module docstring); with `max_tokens`,
    the drafts of a forward capped and spent critical row first. A request is finished (its length learnt) by
    `finish(state)`, by `end_step()`, or when it disappears from the states passed to `budgets`.
    `budgets_rows(rows)` is the same split for a caller that keeps its rows as arrays (the vLLM proposer)."""

    def __init__(self, caps: ClassCaps = ClassCaps(), max_tokens: int | None = None, *,
                 latency: LatencyModel | None = None, lengths: LengthClassifier | None = None,
                 length_config: LengthConfig = LengthConfig(), acceptance: AcceptanceRate | None = None) -> None:
        if max_tokens is not None and max_tokens < 0:
            raise ValueError(f"draft allowance must be >= 0, got {max_tokens}")
        self.caps, self.max_tokens, self.latency = caps, max_tokens, latency
        self.acceptance = acceptance if acceptance is not None else AcceptanceRate()
        self.lengths = lengths if lengths is not None else LengthClassifier(length_config)
        self._live: dict[Hashable, RequestState] = {}  # requests seen by budgets and not finished
        self._done: set[Hashable] = set()  # requests whose length was learnt this step
        # the last priced batch: (its keys, [B] each row's share, own cost and extra cost of drafting)
        self._prices: tuple[Sequence[Hashable], np.ndarray, np.ndarray, np.ndarray] | None = None
        self._expected: dict[Hashable, float] = {}  # req -> expected accepted tokens of its pending draft
        self._calib = [0.0, 0.0]  # accepted tokens, expected ones (path probabilities) of verified drafts
        self.spent: Counter = Counter()  # drafted tokens per length class since the last take_spent()
        self._rows = _RowSlots()
        self._batch: tuple[RowBatch, np.ndarray] | None = None  # the last budgets_rows batch and its slots
        self.skipped = 0  # budgets calls that `nothing_pays` settled before pricing a draft
        self._caps: dict[tuple[int, int], np.ndarray] = {}  # (rows, cap) -> [rows] that cap (read only)

    def budgets(self, states: Sequence[RequestState]) -> list[int]:
        rows = RowBatch.of(states)
        slots = self._rows.slots(rows.keys)
        self._account(rows, slots)
        ids = {s.req_id for s in states}  # a request gone from the batch is finished: its length learnt
        for rid in [r for r in self._live if r not in ids]:
            self._learn(self._live[rid])
        for s in states:
            self._live[s.req_id] = s
        if not states:
            return []
        self.lengths.set_max_len(max(s.max_new_tokens for s in states))
        uniform = self.caps.uniform()
        if uniform is None:  # each row's class sets its cap
            caps = np.array([getattr(self.caps, self.classify(s)) for s in states], np.int64).clip(min=0)
            return self._split(rows, slots, caps, lambda i: states[i].classes[-1]).tolist()
        # equal caps: a row's class sets nothing, so only the drafting rows are classified (cached per row)
        out = self._split(rows, slots, np.full(len(states), max(uniform, 0), np.int64), None)
        for i in np.flatnonzero(out).tolist():
            states[i].classes.append(_CLASS_NAMES[self._rows.cls[slots[i]]])
        return out.tolist()

    def classify(self, s: RequestState) -> str:
        """The row's length class now (appended to its classes)."""
        cls = self.lengths.classify(s.problem_id, s.generated)
        s.classes.append(cls)
        return cls

    def budgets_rows(self, rows: RowBatch) -> np.ndarray:
        """[B] int64: `budgets` of these rows, for a caller that finishes or aborts each request itself (none is
        finished by its absence from a batch) and whose class caps are equal. The same `rows.keys` and
        `rows.problems` list objects as the last call promise the same rows. `trim_rows` trims their drafts."""
        cap = self.caps.uniform()
        if cap is None:
            raise TypeError(f"budgets_rows needs equal class caps (ClassCaps.uniform), got {self.caps}: "
                            f"call budgets(states)")
        slots = self._rows.slots(rows.keys)
        self._batch = (rows, slots)
        self._account(rows, slots)
        n = len(rows)
        if not n:
            return np.zeros(0, np.int64)
        self.lengths.set_max_len(int(rows.max_new_tokens.max()))
        caps = self._caps.get((n, cap))
        if caps is None:
            if len(self._caps) > 64:
                self._caps.clear()
            caps = self._caps[(n, cap)] = np.full(n, max(int(cap), 0), np.int64)
            caps.flags.writeable = False
        return self._split(rows, slots, caps, None)

    def _split(self, rows: RowBatch, slots: np.ndarray, caps: np.ndarray, classify) -> np.ndarray:
        """[B] what each row drafts under its class cap; `classify(i)` names the class drafting row i drafts
        under (None: its length class, cached per row)."""
        acc = self.acceptance
        p = acc.rates(acc.rows.slots(rows.keys), acc.problems.slots(rows.problems))  # [B] per-token acceptance
        remaining = np.maximum(self._remaining(rows, slots), 1.0)  # [B] predicted tokens still to come
        if self.latency is None:  # unpriced: every row its cap, leveled to the critical path
            best = caps
            need = _pace_draft(remaining, p, horizon=float((remaining / _tokens_per_forward(best, p)).max()), most=best)
        elif self.nothing_pays(rows, caps, p, remaining):
            self.skipped += 1
            self._prices = None  # no row drafts: no draft of this batch to cut
            best = need = np.zeros(len(rows), np.int64)
        else:
            best, need = self._priced(rows, caps, p, remaining)
        if self.max_tokens is None:
            out = np.asarray(need, np.int64)
        else:  # the forward's drafts capped: spent critical row first
            at_best = remaining / _tokens_per_forward(best, p)  # [B] forwards each row needs drafting its best
            out, left = np.zeros(len(rows), np.int64), self.max_tokens
            for i in np.argsort(-at_best, kind="stable"):
                if left <= 0:
                    break
                out[i] = int(min(need[i], left))
                left -= out[i]
        drafting = out > 0
        n_drafting = int(np.count_nonzero(drafting))
        if n_drafting < len(out):  # a row that does not draft ages its own acceptance evidence
            acc_rows = acc.rows.slots(rows.keys)
            acc.idle_slots(acc_rows if not n_drafting else acc_rows[~drafting])
            if not n_drafting:
                return out
        idx = np.flatnonzero(drafting)  # the class each drafting row drafts under this step
        if classify is None:
            self._length_classes(rows, slots, idx)
        else:
            for i in idx.tolist():
                self._rows.cls[slots[i]] = _CLASS_CODE[classify(i)]
        return out

    def _length_classes(self, rows: RowBatch, slots: np.ndarray, idx: np.ndarray) -> None:
        """Rows idx draft under their length class now, cached per row (LengthClassifier.classify_span)."""
        r, lengths = self._rows, self.lengths
        ver, ss, g = lengths.version, slots[idx], rows.generated[idx]
        for j in np.flatnonzero((r.c_version[ss] != ver) | (g > r.c_last[ss])).tolist():
            cls, last = lengths.classify_span(rows.problems[idx[j]], int(g[j]))
            s = ss[j]
            r.c_code[s], r.c_last[s], r.c_version[s] = _CLASS_CODE[cls], last, ver
        r.cls[ss] = r.c_code[ss]

    def nothing_pays(self, rows: RowBatch, caps: np.ndarray, p: np.ndarray, remaining: np.ndarray) -> bool:
        """True only if `_priced` would give every row 0 (then it need not run). Draft d costs at least c_tok * d
        more per forward and gains at most (share + own cost) * d * p, so a row with p * (share + row) < c_tok
        drafts nothing; its share is c_base / B, or c_base / m in the critical group, whose size at m = 1 bounds
        m from below (m0, from an upper bound of the critical path). Margins keep it true in floating point."""
        lat = self.latency
        ctx = rows.prompt_len + rows.generated  # [B]
        every = bool(caps.all())
        # A quick no: some row pays even alone (its own cost is monotone in its context: the longest's is the most)
        if every and float(p.max()) * (lat.c_base / len(rows) + (lat.c_tok + lat.c_other * float(ctx.max()))) > \
                lat.c_tok * (1.0 - 1e-6):
            return False
        row = lat.c_tok + lat.c_other * ctx  # [B] own cost per forward
        # Only the rows that may draft can pay (p, ctx_can, row_can, rem_can: theirs); every row counts in the group.
        ctx_can, row_can, rem_can = ctx, row, remaining  # [C]
        if not every:
            can = caps > 0  # [B]
            if not np.count_nonzero(can):
                return True
            p, ctx_can, row_can, rem_can = p[can], ctx[can], row[can], remaining[can]
        r_lo, r_hi = float(row_can.min()), float(row_can.max())
        if lat.c_tok < 1e-6 * (lat.c_base + float(row.max())):  # degenerate prices: no margin is safe
            return False
        q_lo, q_hi = max(float(p.min()), 0.0), min(float(p.max()), 1.0)
        if q_hi * (lat.c_base / len(rows) + r_hi) > lat.c_tok * (1.0 - 1e-6):
            return False  # some row might pay even off the critical group
        # The loose bound first (scalars): every row's first draft token surely pays alone at m = 1.
        r_max = float(remaining.max())
        extra = lat.c_tok + lat.c_draft + lat.c_draft_kv * float(ctx.max())
        if every and (lat.c_base + r_lo) * q_lo > extra * (1 + 1e-6) + 1e-12 * (lat.c_base + r_hi):
            m0 = max(int(np.count_nonzero(remaining > r_max / ((1.0 + q_lo) * (1.0 - 1e-12)) * (1 + 1e-9))), 1)
            if q_hi * (lat.c_base / m0 + r_hi) <= lat.c_tok * (1.0 - 1e-6):
                return True
        # Row by row (arrays): the horizon's bound from each row's own acceptance.
        q = _unit(p)  # [C]
        pay1 = (lat.c_base + row_can) * q > (lat.c_tok + lat.c_draft + lat.c_draft_kv * ctx_can) \
            * (1 + 1e-6) + 1e-12 * (lat.c_base + row_can)  # [C] d >= 1 at m = 1, surely
        # each row's forwards at m = 1, bounded above: the longest
        top = float(np.where(pay1, rem_can / ((1.0 + q) * (1.0 - 1e-12)), rem_can).max())
        if not every:  # a row that cannot draft takes its remaining length
            top = max(top, float(remaining[~can].max()))
        m0 = max(int(np.count_nonzero(remaining > top * (1 + 1e-9))), 1)
        return not np.count_nonzero(q * (lat.c_base / m0 + row_can) > lat.c_tok * (1.0 - 1e-6))

    def _priced(self, rows: RowBatch, caps, p, remaining) -> tuple[np.ndarray, np.ndarray]:
        """([B] each row's priced draft, [B] what it drafts): the critical group's split, row by row in the
        native core (numpy's arithmetic): solo = the cheapest draft at share c_base / n (and the whole c_draft);
        m = 1, then crit = the cheapest at c_base / m, c_draft / m, horizon = max(remaining / E(crit)), group =
        the rows with remaining / E(solo) > horizon (1 + 1e-9), m = its size until it stops growing; the group
        drafts _pace_draft(remaining, p, horizon, crit), the rest solo."""
        lat = self.latency
        ctx = (rows.prompt_len + rows.generated).astype(np.float64)  # [B] context lengths
        row, kv = lat.c_tok + lat.c_other * ctx, lat.c_draft_kv * ctx  # [B] own cost, extra cost of drafting
        pu, most = _unit(p), np.maximum(caps, 0)
        top = min(int(most.max()), _MAX_PRICED)
        d, d1 = _lengths(top + 1)
        e = _tokens_per_forward(d[None, :], pu[:, None], d1)  # [B, D] E(d) by numpy (its power), read by the core
        best, need, share, extra, _, _, _ = _core.price_split(
            row, lat.c_tok, e, None if int(most.min()) >= top else most, remaining, pu, kv, lat.c_base, lat.c_draft)
        self._prices = (rows.keys, share, row, extra)
        return best, need

    def acceptance_rate(self, state: RequestState) -> float:
        """The per-token acceptance rate the row's drafts are expected to have."""
        return self.acceptance.rate(state.req_id, state.problem_id)

    def _remaining(self, rows: RowBatch, slots: np.ndarray) -> np.ndarray:
        """[B] each row's predicted tokens still to come: min(E[L | L >= generated], max_new_tokens) -
        generated, the expectation cached per row (LengthClassifier.expected_span)."""
        r, ver, g = self._rows, self.lengths.version, rows.generated
        for i in np.flatnonzero((r.e_version[slots] != ver) | (g > r.e_last[slots])).tolist():
            s = slots[i]
            r.e[s], r.e_last[s] = self.lengths.expected_span(rows.problems[i], int(g[i]))
            r.e_version[s] = ver
        return np.minimum(r.e[slots], rows.max_new_tokens) - g

    def _account(self, rows: RowBatch, slots: np.ndarray) -> None:
        """Fold in what each row's last step drafted and accepted (budgets runs once per engine step)."""
        r = self._rows
        d = rows.drafted - r.drafted[slots]  # [B]
        if np.count_nonzero(d > 0):
            idx = np.flatnonzero(d > 0)  # rows whose drafts were verified since
            di, ai = d[idx], (rows.accepted - r.accepted[slots])[idx]
            every = len(idx) == len(d)
            keys = rows.keys if every else [rows.keys[i] for i in idx.tolist()]
            problems = rows.problems if every else [rows.problems[i] for i in idx.tolist()]
            for c, x in zip(r.cls[slots[idx]].tolist(), di.tolist()):
                self.spent[_CLASS_NAMES[c]] += x
            for key, a in zip(keys, ai.tolist()):
                x = self._expected.pop(key, None)
                if x is not None:
                    self._calib[0] += a
                    self._calib[1] += x
            self.acceptance.record_batch(keys, problems, di, ai)
        r.drafted[slots] = rows.drafted
        r.accepted[slots] = rows.accepted

    def finish(self, state: RequestState) -> None:
        """The request left the batch: count its last step's drafts and learn its length."""
        self._account(RowBatch.of([state]), self._rows.slots([state.req_id]))
        self._rows.drop(state.req_id)
        self.acceptance.rows.drop(state.req_id)
        self._learn(state)

    def _learn(self, state: RequestState) -> None:
        """Record a finished request's length (once per request id and step)."""
        if state.req_id in self._done:
            return
        self._done.add(state.req_id)
        self._live.pop(state.req_id, None)
        self.lengths.record(state.problem_id, state.generated)

    def abort(self, state: RequestState) -> None:
        """Forget a failed request: its partial drafts count nowhere, its length is not learnt, and its id may
        run again this step."""
        self._rows.drop(state.req_id)
        self._expected.pop(state.req_id, None)
        self.acceptance.rows.drop(state.req_id)
        self._live.pop(state.req_id, None)

    def take_spent(self) -> dict[str, int]:
        """Drafted tokens per length class since the last call (and reset)."""
        out, self.spent = dict(self.spent), Counter()
        return out

    def end_step(self) -> None:
        self._rows.clear()
        self._batch = None
        self.acceptance.end_step()  # problems decay: one that stopped drafting is probed again later
        self._calib = [c * self.acceptance.decay for c in self._calib]
        self._expected.clear()
        for s in list(self._live.values()):
            self._learn(s)
        self._done.clear()

    @property
    def trims(self) -> bool:
        """Priced drafts are trimmed (unpriced ones are kept as proposed)."""
        return self.latency is not None

    def trim(self, states: Sequence[RequestState], drafts: DraftBatch) -> DraftBatch:
        """Each draft cut to the prefix with the fewest expected seconds per emitted token, node i accepted
        with probability its path probability x the calibration (accepted / expected over the verified
        drafts): a draft as long as the cap but sure only of its first tokens keeps those."""
        if self.latency is None or self._prices is None:
            return drafts
        at = {k: i for i, k in enumerate(self._prices[0])}
        where = np.fromiter((at.get(s.req_id, -1) for s in states), np.int64, len(states))
        return drafts.capped(self._cut([s.req_id for s in states], where, drafts, 0.0))

    def trim_rows(self, index: np.ndarray, drafts: DraftBatch, match_factor: float = 0.0) -> np.ndarray:
        """[D] the nodes each draft keeps: rows `index` (positions in the last `budgets_rows` batch, in order),
        each draft cut to match_factor x its match length first (0: not), then by `trim`'s rule."""
        rows = None if self._batch is None else self._batch[0]
        if self.latency is None or self._prices is None or rows is None or self._prices[0] is not rows.keys:
            # nothing to cut by price (unpriced, or the last batch was not priced: nothing paid)
            return _core.cut_chains(np.ascontiguousarray(drafts.probs, np.float64), drafts.offsets, drafts.match_len,
                                    float(match_factor), None, _NONE, _NONE, _NONE, 0.0, 1.0)[0]
        return self._cut([rows.keys[i] for i in index.tolist()], np.asarray(index, np.int64), drafts, match_factor)

    def _cut(self, keys: Sequence[Hashable], where: np.ndarray, drafts: DraftBatch, match_factor: float) -> np.ndarray:
        """[B] the nodes each draft keeps: at most match_factor x its match length (0: no such cap), then, where
        priced (where[b] >= 0, the row's place in the priced batch), by `trim`'s rule (dasrl/_core cut_chains).
        Records each cut draft's expected accepted tokens (its raw path probabilities)."""
        a, x = self._calib
        calib = (a + _CALIB_PRIOR) / (x + _CALIB_PRIOR)
        priced = where >= 0  # [B]
        at = where if priced.all() else np.where(priced, where, 0)
        share, row, kv = (v[at] for v in self._prices[1:])
        keep, expected = _core.cut_chains(np.ascontiguousarray(drafts.probs, np.float64), drafts.offsets,
                                          drafts.match_len, float(match_factor), priced.view(np.uint8), share, row, kv,
                                          self.latency.c_tok, calib)
        cut = np.flatnonzero(priced & (keep > 0))
        for b, e in zip(cut.tolist(), expected[cut].tolist()):
            self._expected[keys[b]] = e
        return keep

    def parts(self) -> dict[str, object]:
        """The learnt state a session saves, by name (each with state_dict / load_state_dict)."""
        return {"acceptance_rate": self.acceptance, "lengths": self.lengths}
