"""SpecEngine: batched, lossless speculative generation over a Hugging Face causal LM.

One step, for the live batch (rows are the prefix [0, live) of the KV cache)::

    budgets  = policy.budgets(states)                  # draft cap per row (0 = plain decode)
    drafts   = drafter.propose(req_ids, caps)          # chain or tree per row, <= cap tokens
    drafts   = policy.trim(states, drafts)
    inputs   = [pending token, draft nodes..., pad]    # [B, 1 + k_max], tree/causal 4D mask
    logits   = one forward (only real positions reach the lm_head)
    targets  = position-keyed samples at every input position
    verdicts = verify(draft, targets) per row           # accepted + one recovered/bonus token
    commit: tokens appended (stops applied token by token), cache lengths, stats
    drafter.observe(...); finished rows leave the batch (swap-remove in the cache)

The *pending* token of a row is its last emitted token: its K/V are not in the cache yet, so each step
feeds it first. A row's cache length is therefore prompt_len + generated - 1.

Nothing is committed until the whole batch is verified: an exception in a step leaves every row as it
was before the step (EngineStepError carries those consistent partial completions).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import numpy as np
import torch

from dasrl.drafter.base import EMPTY_DRAFT, Draft, Drafter, problem_key
from dasrl.engine.attention import attention_implementation, register
from dasrl.engine.cache import RowCache
from dasrl.engine.sampling import SamplingParams, draw
from dasrl.engine.verify import depths, verify
from dasrl.engine.rows import Job, Row, validate_job
from dasrl.policy.base import BudgetPolicy, NoSpeculation


@dataclass(frozen=True)
class EngineConfig:
    """Static settings of a SpecEngine."""

    max_context: int | None = None
    """Context limit in tokens (prompt + output); None = the model's max_position_embeddings."""
    num_threads: int | None = None
    """torch intra-op threads; None = the CPU cores this process may run on."""
    attention: str = "gqa"
    """'gqa': grouped-query SDPA without K/V repeat (fast, registered for the engine); 'model': as loaded."""
    initial_capacity: int = 64
    """KV slots allocated beyond the longest prompt at first (the cache grows as needed)."""

    def __post_init__(self) -> None:
        if self.max_context is not None and self.max_context < 2:
            raise ValueError(f"max_context must be >= 2, got {self.max_context}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.attention not in ("gqa", "model"):
            raise ValueError(f"attention must be 'gqa' or 'model', got {self.attention!r}")


@dataclass
class Completion:
    """One request's result."""

    req_id: Hashable
    prompt_ids: list[int]
    token_ids: list[int]
    """Generated tokens, including the stop token that ended it (if any)."""
    logprobs: list[float]
    """Log-probability of each generated token under the sampling distribution."""
    finish_reason: str | None
    """'stop' (stop token or string), 'length' (max_new_tokens), 'context' (model limit); None = unfinished."""
    forwards: int = 0
    """Target forwards this request took part in (prefill included)."""
    drafted: int = 0
    """Draft tokens verified for it."""
    accepted: int = 0
    """Draft tokens accepted (emitted as they were drafted)."""


@dataclass(frozen=True)
class StepInfo:
    """What one engine step did (step 0 is the prefill)."""

    step: int
    batch_size: int
    """Live rows in this step's forward."""
    tokens: int
    """Input tokens in the forward (rows x positions actually computed, padding excluded)."""
    new_tokens: int
    """Output tokens committed this step (all rows)."""
    drafted: int
    accepted: int
    finished: int
    """Rows that finished (and left the batch) this step."""
    elapsed_s: float
    """Seconds since generate() started."""
    draft_s: float
    """Seconds in the policy and drafter."""
    verify_s: float
    """Seconds in the forward, sampling and verification."""
    width: int = 1
    """Positions per row the forward computed: 1 + the longest draft, padding included (prefill: the
    longest prompt). The forward's cost follows batch_size x width, not `tokens`."""
    kv_tokens: int = 0
    """Cached context tokens the forward read, summed over rows (0 at prefill)."""


@dataclass
class RunStats:
    """Totals of the last generate() call."""

    steps: int = 0
    forwards: int = 0
    new_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    wall_s: float = 0.0

    def add(self, info: StepInfo) -> None:
        self.steps += 1
        self.forwards += 1
        self.new_tokens += info.new_tokens
        self.drafted += info.drafted
        self.accepted += info.accepted
        self.draft_s += info.draft_s
        self.verify_s += info.verify_s
        self.wall_s = info.elapsed_s


class EngineStepError(RuntimeError):
    """A step failed; `partial` holds every request as it stood before that step."""

    def __init__(self, step: int, partial: list[Completion], cause: BaseException) -> None:
        super().__init__(f"generation failed in step {step}: {type(cause).__name__}: {cause}")
        self.step, self.partial = step, partial


def default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class SpecEngine:
    """Batched speculative generation; outputs equal plain decoding's token for token."""

    def __init__(self, model: torch.nn.Module, tokenizer=None, config: EngineConfig = EngineConfig()) -> None:
        self.model, self.tokenizer, self.config = model.eval(), tokenizer, config
        torch.set_num_threads(config.num_threads or default_threads())
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.vocab_size = int(self.lm_head.weight.shape[0])
        self.max_context = int(config.max_context or model.config.max_position_embeddings)
        self.attn_name = register() if config.attention == "gqa" else model.config._attn_implementation
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos = gen_eos if gen_eos is not None else getattr(tokenizer, "eos_token_id", None)
        self.eos_ids: tuple[int, ...] = tuple(eos) if isinstance(eos, (list, tuple)) else (
            () if eos is None else (int(eos),))
        self.last_run = RunStats()

    # ------------------------------------------------------------------ public API
    def generate(self, prompts: Sequence[Sequence[int]], *, seeds: Sequence[int] | None = None,
                 sampling: SamplingParams = SamplingParams(), drafter: Drafter | None = None,
                 policy: BudgetPolicy | None = None, max_new_tokens: int = 256,
                 stop_token_ids: Sequence[int] | None = None, stop_strings: Sequence[str] = (),
                 ignore_eos: bool = False, req_ids: Sequence[Hashable] | None = None,
                 problem_ids: Sequence[Hashable] | None = None,
                 on_step: Callable[[StepInfo], None] | None = None) -> list[Completion]:
        """Generate a completion per prompt. All input is validated before any work starts."""
        stops = set(stop_token_ids or ()) | (set() if ignore_eos else set(self.eos_ids))
        job = validate_job(prompts=prompts, seeds=seeds, sampling=sampling, max_new_tokens=max_new_tokens,
                           stop_ids=stops, stop_strings=stop_strings, req_ids=req_ids,
                           problem_ids=problem_ids, vocab_size=self.vocab_size,
                           max_context=self.max_context, tokenizer=self.tokenizer)
        policy = policy if policy is not None else NoSpeculation()
        self.last_run = stats = RunStats()
        rows = [Row.new(job, i) for i in range(len(job.prompts))]
        done: list[Row] = []
        started: list[Row] = []
        t_start = time.perf_counter()
        step = 0
        try:
            with torch.inference_mode(), attention_implementation(self.model, self.attn_name):
                if drafter is not None:
                    for r in rows:
                        pid = r.problem_id if r.problem_id is not None else problem_key(r.prompt)
                        drafter.start(r.req_id, pid, r.prompt)
                        started.append(r)
                cache = RowCache.for_model(self.model, rows=len(rows),
                                           capacity=max(map(len, job.prompts)) + self.config.initial_capacity)
                live = list(rows)
                info = self._prefill(job, cache, live, done, drafter, t_start)
                while True:
                    stats.add(info)
                    if on_step is not None:
                        on_step(info)
                    if not live:
                        break
                    step += 1
                    info = self._step(job, cache, live, done, drafter, policy, step, t_start)
        except Exception as exc:
            if drafter is not None:
                for r in started:
                    if r not in done:
                        drafter.finish(r.req_id)
            raise EngineStepError(step, [r.completion() for r in rows], exc) from exc
        return [r.completion() for r in rows]

    # ------------------------------------------------------------------ the steps
    def _prefill(self, job: Job, cache: RowCache, live: list[Row], done: list[Row],
                 drafter: Drafter | None, t_start: float) -> StepInfo:
        """One right-padded forward over every prompt; samples output position 0 of each row."""
        t0 = time.perf_counter()
        lens = np.array([len(r.prompt) for r in live], dtype=np.int64)  # [B]
        batch, width = len(live), int(lens.max())
        ids = np.zeros((batch, width), dtype=np.int64)  # [B, L]
        for b, r in enumerate(live):
            ids[b, : lens[b]] = r.prompt
        pos = torch.arange(width).expand(batch, width)  # [B, L]
        j = torch.arange(width)
        lens_t = torch.as_tensor(lens)
        keep = (j[None, :] < lens_t[:, None])[:, None, :] | torch.eye(width, dtype=torch.bool)[None]  # [B,L,L]
        mask = keep & torch.ones(width, width, dtype=torch.bool).tril()[None]  # [B, L, L]
        last = torch.as_tensor(lens - 1)  # [B]
        logits = self._forward(cache, ids=torch.as_tensor(ids), pos=pos, slots=pos.clone(),
                               mask=mask, view_len=width, rows=torch.arange(batch), cols=last)  # [B, V]
        tokens, logps = draw(logits, job.sampling, seeds=np.array([r.seed for r in live]),
                             positions=np.zeros(batch, dtype=np.int64))
        cache.lengths[:batch] = lens
        new = 0
        for b, r in enumerate(live):
            new += r.append(tokens[b : b + 1], logps[b : b + 1], job)
            r.state.forwards += 1
        if drafter is not None:
            for b, r in enumerate(live):
                drafter.observe(r.req_id, r.out[-1:])
        t1 = time.perf_counter()
        finished = self._retire(cache, live, done, drafter)
        return StepInfo(step=0, batch_size=batch, tokens=int(lens.sum()), new_tokens=new, drafted=0, accepted=0,
                        finished=finished, elapsed_s=time.perf_counter() - t_start, draft_s=0.0,
                        verify_s=t1 - t0, width=int(lens.max()), kv_tokens=0)

    def _step(self, job: Job, cache: RowCache, live: list[Row], done: list[Row], drafter: Drafter | None,
              policy: BudgetPolicy, step: int, t_start: float) -> StepInfo:
        t0 = time.perf_counter()
        batch = len(live)
        drafts = self._drafts(live, drafter, policy)
        t1 = time.perf_counter()

        # Inputs: [pending, draft nodes..., padding] per row, with a tree/causal mask.
        n = np.array([len(d) for d in drafts], dtype=np.int64)  # [B]
        q = 1 + int(n.max())
        lengths = cache.lengths[:batch].copy()  # [B] committed tokens; the pending token goes at slot L
        ids = np.zeros((batch, q), dtype=np.int64)  # [B, q]
        offs = np.zeros((batch, q), dtype=np.int64)  # [B, q] position offset from L
        anc = np.zeros((batch, q, q), dtype=bool)  # [B, q, q] query j may see new token k
        node_depth = []
        for b, (r, d) in enumerate(zip(live, drafts)):
            k = len(d)
            dep = depths(d.parents)  # [k]
            node_depth.append(dep)
            ids[b, 0] = r.out[-1]
            ids[b, 1 : 1 + k] = d.tokens
            ids[b, 1 + k :] = r.out[-1]  # padding: any valid id
            offs[b, 1 : 1 + k] = 1 + dep
            offs[b, 1 + k :] = np.arange(1 + k, q)
            anc[b, :, 0] = True
            for i, p in enumerate(d.parents):
                anc[b, 1 + i] = anc[b, 1 + p] if p >= 0 else anc[b, 0]
                anc[b, 1 + i, 1 + i] = True
            anc[b, 1 + k :, :] = False
            anc[b, 1 + k :, 0] = False
            anc[b, np.arange(1 + k, q), np.arange(1 + k, q)] = True  # padding sees only itself
        lengths_t = torch.as_tensor(lengths)
        slots = lengths_t[:, None] + torch.arange(q)[None, :]  # [B, q]
        pos = lengths_t[:, None] + torch.as_tensor(offs)  # [B, q]
        view = int(lengths.max()) + q
        mask = (torch.arange(view)[None, :] < lengths_t[:, None])[:, None, :].repeat(1, q, 1)  # [B, q, S]
        mask.scatter_(2, slots[:, None, :].expand(batch, q, q), torch.as_tensor(anc))
        real = torch.arange(q)[None, :] <= torch.as_tensor(n)[:, None]  # [B, q]
        rows_i, cols_i = torch.nonzero(real, as_tuple=True)  # [N] each, row-major: row b's 1 + n_b entries
        logits = self._forward(cache, ids=torch.as_tensor(ids), pos=pos, slots=slots, mask=mask,
                               view_len=view, rows=rows_i, cols=cols_i)  # [N, V]

        # Targets at every real input position, with the uniforms of their output positions.
        seeds = np.concatenate([np.full(1 + len(d), r.seed) for r, d in zip(live, drafts)])
        outpos = np.concatenate([len(r.out) + np.concatenate([[0], 1 + dep]) for r, dep in zip(live, node_depth)])
        tokens, logps = draw(logits, job.sampling, seeds=seeds, positions=outpos)  # [N] each
        starts = np.concatenate([[0], np.cumsum(1 + n)])
        verdicts = [verify(d, tokens[starts[b] : starts[b + 1]]) for b, d in enumerate(drafts)]
        t2 = time.perf_counter()

        # Commit: nothing above changed any row.
        new = acc = 0
        for b, (r, d, v) in enumerate(zip(live, drafts, verdicts)):
            path = v.path
            if len(path) and not np.array_equal(path, np.arange(len(path))):
                base = int(lengths[b]) + 1
                cache.move_slots(b, src=base + path, dst=base + np.arange(len(path)))
            kept = r.append(v.tokens, logps[starts[b] : starts[b + 1]][v.emit_at], job)
            cache.lengths[b] = lengths[b] + kept
            r.state.forwards += 1
            r.state.drafted += len(d)
            r.state.accepted += min(v.accepted, kept)
            new += kept
            acc += min(v.accepted, kept)
        if drafter is not None:
            for r, v in zip(live, verdicts):
                drafter.observe(r.req_id, r.out[len(r.out) - r.last_kept:])
        finished = self._retire(cache, live, done, drafter)
        t3 = time.perf_counter()
        return StepInfo(step=step, batch_size=batch, tokens=int((1 + n).sum()), new_tokens=new,
                        drafted=int(n.sum()), accepted=acc, finished=finished,
                        elapsed_s=t3 - t_start, draft_s=t1 - t0, verify_s=t2 - t1 + (t3 - t2), width=int(q),
                        kv_tokens=int(lengths.sum()))

    # ------------------------------------------------------------------ helpers
    def _drafts(self, live: list[Row], drafter: Drafter | None, policy: BudgetPolicy) -> list[Draft]:
        """Policy budgets, capped by each row's room, then the drafter's proposals, trimmed and checked."""
        if drafter is None:
            return [EMPTY_DRAFT] * len(live)
        states = [r.state for r in live]
        budgets = list(policy.budgets(states))
        if len(budgets) != len(live):
            raise ValueError(f"policy returned {len(budgets)} budgets for {len(live)} live requests")
        caps = [max(0, min(int(b), r.room(self.max_context) - 1)) for b, r in zip(budgets, live)]
        if not any(caps):
            return [EMPTY_DRAFT] * len(live)
        drafts = list(drafter.propose([r.req_id for r in live], caps))
        drafts = list(policy.trim(states, drafts))
        if len(drafts) != len(live):
            raise ValueError(f"drafter/policy returned {len(drafts)} drafts for {len(live)} live requests")
        out = []
        for r, d, cap in zip(live, drafts, caps):
            if len(d) > cap:
                d = Draft(d.tokens[:cap], d.parents[:cap], d.probs[:cap], d.match_len)
            if len(d) and (int(d.tokens.min()) < 0 or int(d.tokens.max()) >= self.vocab_size):
                raise ValueError(f"draft for request {r.req_id!r} has token ids outside [0, {self.vocab_size})")
            out.append(d)
        return out

    def _forward(self, cache: RowCache, *, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                 mask: torch.Tensor, view_len: int, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """Decoder over ids [B, q] writing K/V at slots [B, q]; lm_head only at (rows, cols): [N, V]."""
        cache.prepare(slots, view_len)
        hidden = self.decoder(input_ids=ids, attention_mask=mask[:, None], position_ids=pos, cache=cache,
                              use_cache=True).last_hidden_state  # [B, q, H]
        return self.lm_head(hidden[rows, cols])  # [N, V]

    def _retire(self, cache: RowCache, live: list[Row], done: list[Row], drafter: Drafter | None) -> int:
        """Finished rows leave the batch (swap-remove keeps live rows a prefix of the cache)."""
        finished = [b for b, r in enumerate(live) if r.finish is not None]
        for b in reversed(finished):
            row = live[b]
            if drafter is not None:
                drafter.finish(row.req_id)
            done.append(row)
            cache.remove_row(b)
            last = live.pop()
            if b < len(live):
                live[b] = last
        return len(finished)
