"""SpecEngine: batched, lossless speculative generation over a Hugging Face causal LM (docs/engine.md).

One step over the live rows (the prefix [0, live) of the KV cache): policy budgets, drafter proposals, one
packed forward over every row's pending token and draft nodes (packing.py), position-keyed samples, verify,
commit, finished rows leave. A row's pending token is its last emitted one, not yet in the cache: its cache
length is prompt_len + generated - 1. Nothing is committed until the whole batch is verified, so a failed
step leaves every row as it was (EngineStepError carries those partial completions).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Hashable, Iterator, Sequence

import numpy as np
import torch

from dasrl.drafter.base import DraftBatch, Drafter, problem_key
from dasrl.engine.attention import attention_implementation, engine_thread, eval_mode, register
from dasrl.engine.cache import RowCache
from dasrl.engine.compat import CacheKeywordMissing, cache_keyword
from dasrl.engine.gemm import (HEAD_PADDING, INVARIANT_PADDING, NO_PADDING, LinearKernels, RowPadding, onednn_available,
                               padded, padded_linears)
from dasrl.engine.guards import UnsupportedModel, check_packed_forward, unsupported_reason
from dasrl.engine.packing import INVARIANT_BUCKET, PackedInputs, pack_drafts, pack_prompts
from dasrl.engine.sampling import SamplingParams, draw
from dasrl.engine.verify import Verdict, verify_batch
from dasrl.engine.rows import Completion, Job, Row, validate_job  # Completion: re-exported
from dasrl.policy.base import BudgetPolicy, FixedBudget

_NO_MASK = torch.ones(1, 1, 1, 1, dtype=torch.bool)  # passed on untouched: packed attention masks itself


@dataclass(frozen=True)
class EngineConfig:
    """Static settings of a SpecEngine."""

    max_context: int | None = None
    """Context limit in tokens (prompt + output); None = the model's max_position_embeddings."""
    num_threads: int | None = None
    """torch intra-op threads, set process-wide at construction; None = leave the host's setting alone."""
    initial_capacity: int = 64
    """KV slots allocated beyond the longest prompt at first (the cache grows as needed)."""
    row_padding: RowPadding = RowPadding()
    """CPU linear layers: row counts in [low, to) computed padded to `to` (gemm.py); RowPadding(low=0) = off."""
    linear_kernels: bool = True
    """CPU float32: each linear by the kernel (oneDNN or MKL) timed faster at its row count (gemm.LinearKernels)."""
    batch_invariant: bool = False
    """A row's logits bit-identical whatever the other rows (CPU, fp32; docs/sampling.md); overrides row_padding."""

    def __post_init__(self) -> None:
        for name, low, optional in (("max_context", 2, True), ("num_threads", 1, True), ("initial_capacity", 0, False)):
            value = getattr(self, name)
            if value is None and optional:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise ValueError(f"EngineConfig: {name} must be an int >= {low}{' or None' if optional else ''}, "
                                 f"got {value!r}")
        for name, kind in (("row_padding", RowPadding), ("linear_kernels", bool), ("batch_invariant", bool)):
            if not isinstance(getattr(self, name), kind):
                raise TypeError(f"EngineConfig: {name} must be a {kind.__name__}, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class StepInfo:
    """What one engine step did (step 0 is the prefill)."""

    step: int
    batch_size: int  # live rows in this step's forward
    tokens: int  # input tokens in the forward (padding excluded)
    new_tokens: int  # output tokens committed this step (all rows)
    drafted: int
    accepted: int
    finished: int  # rows that finished (and left the batch) this step
    elapsed_s: float  # since generate() started
    draft_s: float  # in the policy and drafter
    verify_s: float  # in sampling and verification (the forward excluded)
    forward_s: float = 0.0  # in the packed forward (decoder and lm_head)
    width: int = 1  # tokens of the row that fed the most (1 + the longest draft; prefill: the longest prompt)
    kv_tokens: int = 0  # cached context tokens the forward read, summed over rows (0 at prefill)
    draft_kv_tokens: int = 0  # the same sum over the rows that fed more than one token


class EngineStepError(RuntimeError):
    """A step failed; `partial` holds every request as it stood before that step."""

    def __init__(self, step: int, partial: list[Completion], cause: BaseException) -> None:
        super().__init__(f"generation failed in step {step}: {type(cause).__name__}: {cause}")
        self.step, self.partial = step, partial


_MODEL_LOCKS: "weakref.WeakKeyDictionary[torch.nn.Module, threading.RLock]" = weakref.WeakKeyDictionary()
_MODEL_LOCKS_GUARD = threading.Lock()


def model_lock(model: torch.nn.Module) -> threading.RLock:
    """The one re-entrant lock of `model`, held by every engine forward (SpecEngine.forward_context) and by
    RolloutSession.generate around the whole call."""
    with _MODEL_LOCKS_GUARD:
        return _MODEL_LOCKS.setdefault(model, threading.RLock())


def default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class SpecEngine:
    """Batched speculative generation; outputs equal plain decoding's token for token."""

    def __init__(self, model: torch.nn.Module, tokenizer=None, config: EngineConfig = EngineConfig()) -> None:
        self.model, self.tokenizer, self.config = model, tokenizer, config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        model_max = getattr(model.config, "max_position_embeddings", None)
        if config.max_context is not None and model_max is not None and config.max_context > model_max:
            raise ValueError(f"EngineConfig(max_context={config.max_context}) exceeds the model's "
                             f"max_position_embeddings={model_max}: positions past it were never trained")
        self.max_context = int(config.max_context or model_max)
        self.model_type = str(getattr(model.config, "model_type", type(model).__name__))
        reason = unsupported_reason(model)
        if reason is not None:
            raise UnsupportedModel(f"SpecEngine does not support model type {self.model_type!r}: {reason}")
        self.attn_name = register()
        self.attention_bucket = INVARIANT_BUCKET if config.batch_invariant else 0  # 0: the batch's longest row
        self._bound: tuple | None = None  # the model's shape as the last bind() saw it
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos = gen_eos if gen_eos is not None else getattr(tokenizer, "eos_token_id", None)
        self.eos_ids: tuple[int, ...] = tuple(eos) if isinstance(eos, (list, tuple)) else (
            () if eos is None else (int(eos),))
        self.last_steps: list[StepInfo] = []
        """The StepInfo of each forward of the last generate() call (its totals: dasrl.rollout.StepSummary.of)."""
        self.bind()

    def bind(self) -> None:
        """Derive the decoder, head, vocabulary and linear kernels from the model as it is now (the trainer may
        swap modules, dtypes or devices between calls); when its modules, dtypes or devices changed, probe the
        packed forward again, so a model the engine cannot run exactly is refused, never run."""
        with model_lock(self.model):
            model, config = self.model, self.config
            shape = (tuple((id(m), type(m)) for m in model.modules()),
                     tuple(sorted({(p.dtype, p.device) for p in model.parameters()}, key=str)))
            if shape == self._bound:
                return
            self.decoder = model.get_decoder()
            try:
                self._cache_kw = cache_keyword(self.decoder)  # its name differs by transformers release
            except CacheKeywordMissing as e:
                raise UnsupportedModel(f"SpecEngine does not support model type {self.model_type!r}: {e}") from e
            self.lm_head = model.get_output_embeddings()
            self.vocab_size = int(self.lm_head.weight.shape[0])
            cpu_fp32 = self.lm_head.weight.device.type == "cpu" and self.lm_head.weight.dtype == torch.float32
            self.kernels = LinearKernels.for_model(model) if config.linear_kernels and not config.batch_invariant \
                and cpu_fp32 and onednn_available() else None  # None: F.linear throughout
            # With the tuned kernels padding costs more than it saves (docs/benchmarks.md).
            self.row_padding = INVARIANT_PADDING if config.batch_invariant else \
                NO_PADDING if self.kernels is not None else config.row_padding
            check_packed_forward(self)
            self._bound = shape

    def generate(self, prompts: Sequence[Sequence[int]], *, seeds: Sequence[int] | None = None,
                 sampling: SamplingParams = SamplingParams(), drafter: Drafter | None = None,
                 policy: BudgetPolicy | None = None, max_new_tokens: int = 256,
                 stop_token_ids: Sequence[int] | None = None, stop_strings: Sequence[str] = (),
                 ignore_eos: bool = False, req_ids: Sequence[Hashable] | None = None,
                 stop_lines: Sequence[str] = (), problem_ids: Sequence[Hashable] | None = None,
                 on_step: Callable[[StepInfo], None] | None = None) -> list[Completion]:
        """A completion per prompt, from the model's weights as they are at this call; all input is validated
        before any work starts."""
        if drafter is not None and not isinstance(drafter, Drafter):
            raise TypeError(f"drafter {type(drafter).__name__} lacks the Drafter protocol's methods "
                            f"(dasrl.drafter.base.Drafter; DrafterBase supplies the batch calls)")
        self.bind()
        stops = set(stop_token_ids or ()) | (set() if ignore_eos else set(self.eos_ids))
        job = validate_job(prompts=prompts, seeds=seeds, sampling=sampling, max_new_tokens=max_new_tokens,
                           stop_ids=stops, stop_strings=stop_strings, req_ids=req_ids,
                           problem_ids=problem_ids, vocab_size=self.vocab_size,
                           max_context=self.max_context, tokenizer=self.tokenizer, stop_lines=stop_lines)
        policy = policy if policy is not None else FixedBudget(0)
        self.last_steps = steps = []
        rows = [Row.new(job, i) for i in range(len(job.prompts))]
        done: list[Row] = []
        started: list[Row] = []
        t_start = time.perf_counter()
        step = 0
        try:
            with self.forward_context():
                if drafter is not None:
                    for r in rows:
                        pid = r.problem_id if r.problem_id is not None else problem_key(r.prompt)
                        started.append(r)  # before the call: an interrupt right after start() must abort it
                        try:
                            drafter.start(r.req_id, pid, r.prompt)
                        except Exception:
                            started.pop()  # refused: nothing of it is in the drafter to abort
                            raise
                cache = RowCache.for_model(self.model, rows=len(rows),
                                           capacity=max(map(len, job.prompts)) + self.config.initial_capacity)
                live = list(rows)
                info = self._prefill(job, cache, live, done, drafter, policy, t_start)
                while True:
                    steps.append(info)
                    if on_step is not None:
                        on_step(info)
                    if not live:
                        break
                    step += 1
                    info = self._step(job, cache, live, done, drafter, policy, step, t_start)
        except BaseException as exc:  # KeyboardInterrupt too: no request may stay live in the drafter
            self._abort(rows, started, done, drafter, policy)
            if not isinstance(exc, Exception):
                raise
            raise EngineStepError(step, [r.completion() for r in rows], exc) from exc
        return [r.completion() for r in rows]

    @staticmethod
    def _abort(rows: list[Row], started: list[Row], done: list[Row], drafter: Drafter | None,
               policy: BudgetPolicy) -> None:
        """A failed generate: unfinished requests are forgotten, not learnt from; finished ones stay."""
        finished = set(map(id, done))
        if drafter is not None:
            for r in started:
                if id(r) not in finished:
                    drafter.abort(r.req_id)
        for r in rows:
            if id(r) not in finished:
                policy.abort(r.state)

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        """What every engine forward runs in: the model's lock first (the attention and linears are swapped on
        the shared model, so two overlapping contexts would undo each other's swap), eval and inference mode,
        the engine's attention, the linears' kernels and padding; the trainer's modes are restored on exit."""
        with model_lock(self.model), engine_thread(), eval_mode(self.model), torch.inference_mode(), \
                attention_implementation(self.model, self.attn_name), \
                padded_linears(self.model, self.row_padding, self.kernels):
            yield

    def _prefill(self, job: Job, cache: RowCache, live: list[Row], done: list[Row], drafter: Drafter | None,
                 policy: BudgetPolicy, t_start: float) -> StepInfo:
        """One packed forward over every prompt; samples output position 0 of each row."""
        t0 = time.perf_counter()
        inputs = pack_prompts([r.prompt for r in live], bucket=self.attention_bucket)
        lens = np.diff(inputs.starts)  # [B]
        logits = self._forward(cache, inputs, at=inputs.starts[1:] - 1)  # [B, V] at each prompt's last token
        t1 = time.perf_counter()
        tokens, logps = draw(logits, job.sampling, seeds=np.array([r.seed for r in live]),
                             positions=np.zeros(len(live), dtype=np.int64))
        t2 = time.perf_counter()
        cache.lengths[: len(live)] = lens
        new = sum(r.append(tokens[b : b + 1], logps[b : b + 1], job) for b, r in enumerate(live))
        for r in live:
            r.state.forwards += 1
        if drafter is not None:
            drafter.observe_batch([r.req_id for r in live], [r.out[-1:] for r in live])
        finished = self._retire(cache, live, done, drafter, policy)
        return StepInfo(step=0, batch_size=len(lens), tokens=int(lens.sum()), new_tokens=new, drafted=0, accepted=0,
                        finished=finished, elapsed_s=time.perf_counter() - t_start, draft_s=0.0,
                        verify_s=t2 - t1, forward_s=t1 - t0, width=int(lens.max()), kv_tokens=0)

    def _step(self, job: Job, cache: RowCache, live: list[Row], done: list[Row], drafter: Drafter | None,
              policy: BudgetPolicy, step: int, t_start: float) -> StepInfo:
        """propose -> pack -> forward -> sample -> verify -> commit (sampling only where verify will look)."""
        t0 = time.perf_counter()
        batch = len(live)
        lengths = cache.lengths[:batch].copy()  # [B] committed tokens; the pending token goes at slot L
        drafts = self._propose(live, drafter, policy)
        t1 = time.perf_counter()
        inputs = pack_drafts(pending=np.array([r.out[-1] for r in live], np.int64), lengths=lengths, drafts=drafts,
                             bucket=self.attention_bucket)
        logits = self._forward(cache, inputs)  # [N, V]: one lm_head over every packed token
        t2 = time.perf_counter()
        q = np.diff(inputs.starts)  # [B]
        seeds = np.repeat(np.array([r.seed for r in live], np.int64), q)  # [N]
        positions = np.repeat(np.array([len(r.out) for r in live], np.int64), q) + inputs.depth  # [N]
        tokens, logps = self._targets(logits, drafts, inputs.starts, job.sampling, seeds=seeds, positions=positions)
        verdicts = verify_batch(drafts, tokens, inputs.starts)
        t3 = time.perf_counter()
        new, acc = self._commit(job, cache, live, drafts, verdicts, logps, inputs.starts, lengths)
        if drafter is not None:
            drafter.observe_batch([r.req_id for r in live], [r.out[len(r.out) - r.last_kept:] for r in live])
        finished = self._retire(cache, live, done, drafter, policy)
        t4 = time.perf_counter()
        return StepInfo(step=step, batch_size=batch, tokens=inputs.layout.tokens, new_tokens=new,
                        drafted=int(drafts.lengths.sum()), accepted=acc, finished=finished,
                        elapsed_s=t4 - t_start, draft_s=t1 - t0, verify_s=t3 - t2, forward_s=t2 - t1,
                        width=int(q.max()), kv_tokens=int(lengths.sum()), draft_kv_tokens=int(lengths[q > 1].sum()))

    def _commit(self, job: Job, cache: RowCache, live: list[Row], drafts: DraftBatch, verdicts: list[Verdict],
                logps: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> tuple[int, int]:
        """Append each row's verified tokens (stops token by token), make a tree's accepted path contiguous in
        the cache, commit cache lengths. Returns (new tokens, accepted draft tokens)."""
        new = acc = 0
        for b, (r, v) in enumerate(zip(live, verdicts)):
            path = v.path
            if len(path) and not np.array_equal(path, np.arange(len(path))):
                base = int(lengths[b]) + 1
                cache.move_slots(b, src=base + path, dst=base + np.arange(len(path)))
            kept = r.append(v.tokens, logps[starts[b] : starts[b + 1]][v.emit_at], job)
            cache.lengths[b] = lengths[b] + kept
            r.state.forwards += 1
            r.state.drafted += int(drafts.lengths[b])
            accepted = min(v.accepted, kept)
            r.state.accepted += accepted
            new, acc = new + kept, acc + accepted
        return new, acc

    def _propose(self, live: list[Row], drafter: Drafter | None, policy: BudgetPolicy) -> DraftBatch:
        """Budgets capped by each row's room (less the pending token), proposals trimmed and checked: the path
        the simulator replays (dasrl.policy.propose)."""
        from dasrl.policy.propose import propose
        return propose(drafter, policy, [r.state for r in live], [r.req_id for r in live],
                       [r.room(self.max_context) - 1 for r in live], self.vocab_size)

    def _targets(self, logits: torch.Tensor, drafts: DraftBatch, starts: np.ndarray, sampling: SamplingParams, *,
                 seeds: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Target tokens and logprobs [N] from the logits [N, V] of every packed token, drawn only where verify
        reads: every row's pending token, then the nodes of rows whose draft survived its first token (-1
        elsewhere)."""
        n = len(positions)
        tokens, logps = np.full(n, -1, np.int64), np.zeros(n, np.float64)
        first = starts[:-1]  # [B]
        tokens[first], logps[first] = self._draw_at(logits, first, sampling, seeds=seeds, positions=positions)
        if len(drafts.tokens):
            row_of = drafts.node_rows()[0]  # [T]
            node = np.arange(len(drafts.tokens)) + row_of + 1  # [T] packed index of each draft node
            hit = (drafts.parents < 0) & (drafts.tokens == tokens[first][row_of])  # [T] root children matched
            alive = np.zeros(len(drafts.lengths), bool)  # [B]
            alive[row_of[hit]] = True
            rest = node[alive[row_of]]  # [M] every node of the surviving rows
            if len(rest):
                tokens[rest], logps[rest] = self._draw_at(logits, rest, sampling, seeds=seeds, positions=positions)
        return tokens, logps

    def _lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head over hidden [M, H] -> [M, V] through the head module itself, rows padded for MKL."""
        head = INVARIANT_PADDING if self.row_padding == INVARIANT_PADDING else \
            NO_PADDING if self.kernels is not None else HEAD_PADDING
        return padded(self.lm_head, hidden, head)

    def _draw_at(self, logits: torch.Tensor, at: np.ndarray, sampling: SamplingParams, *, seeds: np.ndarray,
                 positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return draw(logits[torch.as_tensor(at, device=logits.device)], sampling, seeds=seeds[at],
                    positions=positions[at])

    def _decode(self, cache: RowCache, inputs: PackedInputs) -> torch.Tensor:
        """Decoder over the packed tokens [1, N] (writing their K/V): the final hidden states [N, H]."""
        cache.prepare_packed(inputs.layout.rows, inputs.layout.slots, inputs.view)  # host layout: no sync
        device = self.lm_head.weight.device
        inputs = inputs.to(device)
        return self.decoder(input_ids=inputs.ids, attention_mask=_NO_MASK.to(device), position_ids=inputs.positions,
                            use_cache=True, dasrl_packed=inputs.layout,
                            **{self._cache_kw: cache}).last_hidden_state[0]  # [N, H]

    def _forward(self, cache: RowCache, inputs: PackedInputs, at: np.ndarray | None = None) -> torch.Tensor:
        """Decoder over the packed tokens [1, N]; lm_head at packed indices `at` (default: all): [M, V]."""
        hidden = self._decode(cache, inputs)  # [N, H]
        return self._lm_head(hidden if at is None else hidden[torch.as_tensor(at, device=hidden.device)])  # [M, V]

    def _retire(self, cache: RowCache, live: list[Row], done: list[Row], drafter: Drafter | None,
                policy: BudgetPolicy) -> int:
        """Finished rows leave the batch (swap-remove keeps live rows a prefix of the cache)."""
        finished = [b for b, r in enumerate(live) if r.finish is not None]
        for b in reversed(finished):
            row = live[b]
            # Done before finish(): an interrupt right after it returns must not abort a finished request.
            done.append(row)
            if drafter is not None:
                try:
                    drafter.finish(row.req_id)
                except Exception:
                    done.pop()  # refused: still live in the drafter, so aborted with the others
                    raise
            policy.finish(row.state)
            cache.remove_row(b)
            last = live.pop()
            if b < len(live):
                live[b] = last
        return len(finished)
