"""Input validation of a generate() call (Job) and the mutable state of one request in flight (Row)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Sequence

import numpy as np

from dasrl.engine.sampling import SamplingParams
from dasrl.engine.stops import LineStop
from dasrl.policy.base import RequestState


@dataclass
class Completion:
    """One request's result."""

    req_id: Hashable
    prompt_ids: list[int]
    token_ids: list[int]  # generated tokens, including the stop token that ended it (if any)
    logprobs: list[float]  # of each generated token, as SamplingParams.logprobs_mode says
    finish_reason: str | None  # 'stop', 'length' (max_new_tokens), 'context' (model limit); None = unfinished
    forwards: int = 0  # target forwards this request took part in (prefill included)
    drafted: int = 0  # draft tokens verified for it
    accepted: int = 0  # draft tokens accepted (emitted as they were drafted)


@dataclass(frozen=True)
class Job:
    """A validated generate() call."""

    prompts: list[list[int]]
    seeds: list[int]
    req_ids: list[Hashable]
    problem_ids: list[Hashable | None]
    sampling: SamplingParams
    max_new_tokens: int
    stop_ids: frozenset[int]  # EOS unless ignored, plus stop_token_ids
    stop_strings: tuple[str, ...]
    max_context: int
    tokenizer: object = None
    stop_lines: LineStop | None = None


def _int_list(values: Sequence, what: str) -> list[int]:
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{what} must hold integers, got {v!r}")
        out.append(int(v))
    return out


def prompt_ids(i: int, p: object) -> list[int]:
    """Prompt i as a list of ints, or an error saying what it is instead (also run by RolloutSession.generate
    before it hashes prompts into problem ids)."""
    if isinstance(p, (str, bytes)):
        raise TypeError(f"prompt {i} is a string; pass token ids (tokenize it first)")
    if isinstance(p, (int, np.integer)):
        raise TypeError(f"prompt {i} is the int {int(p)}: prompts is a list of prompts (wrap a single prompt "
                        f"in a list)")
    if hasattr(p, "ndim") and hasattr(p, "tolist"):  # numpy / torch: refused, not flattened, unless 1-D
        if p.ndim != 1:
            raise ValueError(f"prompt {i} is a {p.ndim}-D array of shape {tuple(p.shape)}; each prompt must "
                             f"be 1-D token ids")
        p = p.tolist()
    if not isinstance(p, (list, tuple)):
        raise TypeError(f"prompt {i} is {type(p).__name__} {p!r:.60}; each prompt is a list of token ids")
    return _int_list(p, f"prompt {i}")


def validate_job(*, prompts: Sequence[Sequence[int]], seeds: Sequence[int] | None, sampling: SamplingParams,
                 max_new_tokens: int, stop_ids: set[int], stop_strings: Sequence[str],
                 req_ids: Sequence[Hashable] | None, problem_ids: Sequence[Hashable | None] | None,
                 vocab_size: int, max_context: int, tokenizer, stop_lines: Sequence[str] = ()) -> Job:
    if isinstance(prompts, (str, bytes)) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    clean = []
    for i, p in enumerate(prompts):
        ids = prompt_ids(i, p)
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
        if len(ids) >= max_context:
            raise ValueError(f"prompt {i} has {len(ids)} tokens; the context limit is {max_context} "
                             f"(prompt + at least one new token)")
        clean.append(ids)
    n = len(clean)
    if seeds is None:
        seed_list = list(range(n))
    else:
        if len(seeds) != n:
            raise ValueError(f"got {len(seeds)} seeds for {n} prompts")
        seed_list = _int_list(seeds, "seeds")
        wide = [s for s in seed_list if not -(1 << 63) <= s < 1 << 63]
        if wide:  # the sampler keys on 64-bit seeds: refused here, not at the first draw
            raise ValueError(f"seeds must fit in 64 bits, in [-2**63, 2**63); got {wide[:5]}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    _int_list(stop_ids, "stop_token_ids")  # 1.7 is refused, not truncated to 1
    bad_stop = [t for t in stop_ids if not 0 <= int(t) < vocab_size]
    if bad_stop:
        raise ValueError(f"stop token ids outside the vocabulary [0, {vocab_size}): {bad_stop}")
    for name, value in (("stop_strings", stop_strings), ("stop_lines", stop_lines)):
        if isinstance(value, (str, bytes)):  # a string is a sequence of one-character stops: surely not meant
            raise TypeError(f"{name} must be a list of strings, got the string {value!r} (wrap it in a list)")
    strings = tuple(stop_strings)
    if any(not isinstance(s, str) or not s for s in strings):
        raise ValueError(f"stop strings must be non-empty strings, got {strings!r}")
    if strings and tokenizer is None:
        raise ValueError("stop strings need a tokenizer: SpecEngine(model, tokenizer)")
    ids_list = _per_prompt(req_ids, list(range(n)), "request ids")
    if len(set(ids_list)) != n:
        raise ValueError("request ids must be unique")
    pids = _per_prompt(problem_ids, [None] * n, "problem ids")
    return Job(prompts=clean, seeds=seed_list, req_ids=ids_list, problem_ids=pids, sampling=sampling,
               max_new_tokens=int(max_new_tokens), stop_ids=frozenset(int(t) for t in stop_ids),
               stop_strings=strings, max_context=max_context, tokenizer=tokenizer,
               stop_lines=LineStop(stop_lines, tokenizer) if stop_lines else None)


def _per_prompt(values: Sequence | None, default: list, what: str) -> list:
    out = default if values is None else list(values)
    if len(out) != len(default):
        raise ValueError(f"got {len(out)} {what} for {len(default)} prompts")
    return out


@dataclass(eq=False)
class Row:
    """One request in flight."""

    req_id: Hashable
    problem_id: Hashable | None
    prompt: list[int]
    seed: int
    state: RequestState
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None
    last_kept: int = 0  # tokens committed by the last append

    @staticmethod
    def new(job: Job, i: int) -> "Row":
        state = RequestState(req_id=job.req_ids[i], problem_id=job.problem_ids[i], prompt_len=len(job.prompts[i]),
                             max_new_tokens=job.max_new_tokens)
        return Row(job.req_ids[i], job.problem_ids[i], job.prompts[i], job.seeds[i], state)

    def room(self, max_context: int) -> int:
        """Tokens it may still emit (max_new_tokens and the context limit)."""
        return min(self.state.max_new_tokens - len(self.out), max_context - len(self.prompt) - len(self.out))

    def append(self, tokens: np.ndarray, logprobs: np.ndarray, job: Job) -> int:
        """Append emitted tokens one by one, stopping at the first stop condition; returns how many."""
        kept = 0
        for kept, (tok, lp) in enumerate(zip(tokens.tolist(), logprobs.tolist()), 1):
            self.out.append(int(tok))
            self.logprobs.append(float(lp))
            if (tok in job.stop_ids or (job.stop_strings and self._hit_stop_string(job))
                    or (job.stop_lines is not None and job.stop_lines.hit(self.out))):
                self.finish = "stop"
            elif len(self.out) >= job.max_new_tokens:
                self.finish = "length"
            elif len(self.prompt) + len(self.out) >= job.max_context:
                self.finish = "context"
            if self.finish is not None:
                break
        self.state.generated = len(self.out)
        self.last_kept = kept
        return kept

    def _hit_stop_string(self, job: Job) -> bool:
        longest = max(len(s) for s in job.stop_strings)
        tail = job.tokenizer.decode(self.out[-(longest + 4):])
        return any(s in tail for s in job.stop_strings)

    def completion(self) -> Completion:
        return Completion(req_id=self.req_id, prompt_ids=list(self.prompt), token_ids=list(self.out),
                          logprobs=list(self.logprobs), finish_reason=self.finish, forwards=self.state.forwards,
                          drafted=self.state.drafted, accepted=self.state.accepted)
