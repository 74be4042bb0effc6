"""`dasrl bench proposer`: the host seconds a vLLM proposer takes per engine step, by batch size, without
vLLM: DASProposer.propose_batch beside vLLM's own `suffix` proposer, each called as vLLM's model runner
calls it on the same input batch (docs/benchmarks.md, "Proposer host seconds"). vLLM runs the proposer on
the host between two forwards (custom_class turns async scheduling off): on a GPU these seconds add to
every step.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import numpy as np
import typer

from dasrl.integrations.vllm import DASProposer

VOCAB = 32000
"""The model vocabulary the proposer is told (the workload's token ids are below 30,000)."""


@dataclass(frozen=True)
class ProposerBenchConfig:
    """One `dasrl bench proposer` run."""

    batches: tuple[int, ...] = (16, 64, 256, 512)
    """Live requests per engine step."""
    length: int = 200
    """Tokens of every response."""
    prompt_len: int = 60
    """Tokens of every prompt."""
    k: int = 8
    """num_speculative_tokens."""

    def __post_init__(self) -> None:
        if not self.batches or min(self.batches) < 4 or any(b % 4 for b in self.batches):
            raise ValueError(f"batches must be multiples of 4 (4 siblings per prompt), got {self.batches}")
        if self.length < 8 or self.prompt_len < 1 or self.k < 1:
            raise ValueError(f"need length >= 8, prompt_len >= 1, k >= 1, got {self.length}, {self.prompt_len}, {self.k}")


class RunnerBatch:
    """The fields of vLLM's InputBatch (v1/worker/gpu_input_batch.py) that both proposers read, as vLLM keeps them."""

    def __init__(self, req_ids: list[str], prompt_lens: list[int], token_rows: np.ndarray, num_tokens: list[int]) -> None:
        self.req_ids = req_ids
        self.req_id_to_index = {rid: i for i, rid in enumerate(req_ids)}
        self.num_prompt_tokens = np.asarray(prompt_lens, np.int32)
        self.num_tokens_no_spec = np.asarray(num_tokens, np.int32)
        self.token_ids_cpu = token_rows


class VLLMSuffixProposer:
    """vLLM's `suffix` proposer: SuffixDecodingProposer.propose (vllm/v1/spec_decode/suffix_decoding.py, the
    same in 0.24-0.33 and on main) line for line, over arctic-inference's SuffixDecodingCache at vLLM's
    defaults (tree depth 24, 10,000 cached responses, max_spec_factor 1.0, min_token_prob 0.1)."""

    def __init__(self, num_speculative_tokens: int, max_model_len: int) -> None:
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        from dasrl_lab.sim.vllm_baselines import VLLM_SUFFIX

        self.num_speculative_tokens = num_speculative_tokens
        self.max_tree_depth = VLLM_SUFFIX.max_tree_depth
        self.max_spec_factor = VLLM_SUFFIX.max_spec_factor
        self.min_token_prob = VLLM_SUFFIX.min_token_prob
        self.max_model_len = max_model_len
        self.suffix_cache = SuffixDecodingCache(max_tree_depth=VLLM_SUFFIX.max_tree_depth,
                                                max_cached_requests=VLLM_SUFFIX.max_cached_requests)

    def propose(self, input_batch: RunnerBatch, sampled_token_ids: list[list[int]]) -> list[list[int]]:
        draft_token_ids: list[list[int]] = []
        for i, sampled_ids in enumerate(sampled_token_ids):
            if not sampled_ids:
                draft_token_ids.append([])
                continue
            req_id = input_batch.req_ids[i]
            num_tokens = input_batch.num_tokens_no_spec[i]
            if num_tokens >= self.max_model_len:
                draft_token_ids.append([])
                continue
            index = input_batch.req_id_to_index[req_id]
            if req_id not in self.suffix_cache.active_requests:
                if req_id in self.suffix_cache.cached_requests:
                    self.suffix_cache.evict_cached_response(req_id)
                num_prompt_tokens = input_batch.num_prompt_tokens[index]
                prompt_token_ids = input_batch.token_ids_cpu[index, :num_prompt_tokens]
                self.suffix_cache.start_request(req_id, prompt_token_ids)
            self.suffix_cache.add_active_response(req_id, sampled_ids)
            start = max(0, num_tokens - self.max_tree_depth)
            pattern = input_batch.token_ids_cpu[i, start:num_tokens]
            draft = self.suffix_cache.speculate(
                req_id, pattern, max_spec_tokens=min(self.num_speculative_tokens, self.max_model_len - num_tokens - 1),
                max_spec_factor=self.max_spec_factor, min_token_prob=self.min_token_prob)
            draft_token_ids.append(draft.token_ids)
        for req_id in self.suffix_cache.active_requests - input_batch.req_id_to_index.keys():
            self.suffix_cache.stop_request(req_id)
        return draft_token_ids


def das_proposer(policy: dict, k: int, width: int) -> DASProposer:
    """DASProposer as vLLM builds it (custom_class) on a GPU server, `policy` its additional_config["dasrl"]."""
    from dasrl_lab.models import ensure_hf_folder

    # the embedded model's tokenizer: its digits for counting drafts (the workload's random ids hold none)
    model = SimpleNamespace(max_model_len=width, get_vocab_size=lambda: VOCAB, tokenizer=str(ensure_hf_folder()),
                            tokenizer_revision=None, trust_remote_code=False, skip_tokenizer_init=False)
    return DASProposer(SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k),
                                       additional_config={"dasrl": policy}, model_config=model,
                                       device_config=SimpleNamespace(device_type="cuda")))


def run_one(cfg: ProposerBenchConfig, batch: int, policy: dict, seed: int = 0) -> dict:
    """One policy at one batch size: median host ms per propose call at the full batch, drafted, accepted."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1000, 30000, cfg.prompt_len).tolist() for _ in range(batch // 4)]
    answers = [rng.integers(1000, 30000, cfg.length).tolist() for _ in range(batch // 4)]
    width = cfg.prompt_len + cfg.length + cfg.k + 1
    suffix = policy["policy"] == "suffix"
    prop = VLLMSuffixProposer(cfg.k, width) if suffix else das_proposer(policy, cfg.k, width)
    drafted = accepted = 0
    times: list[float] = []
    for step in range(2):
        truth = []
        for i in range(batch):  # a sibling's re-sample: its prompt's answer with 8 tokens changed
            r = np.array(answers[i // 4])
            r[rng.integers(0, cfg.length, 8)] = rng.integers(1000, 30000, 8)
            truth.append(r.tolist())
        ids = [f"s{step}r{i}" for i in range(batch)]
        rows = {rid: list(prompts[i // 4]) for i, rid in enumerate(ids)}
        new = {rid: [truth[i][0]] for i, rid in enumerate(ids)}
        row_of = {rid: i for i, rid in enumerate(ids)}
        # vLLM's runner.requests: the requests it holds (max_tokens: the row's room past the prompt)
        requests = {rid: SimpleNamespace(sampling_params=SimpleNamespace(max_tokens=width - cfg.prompt_len))
                    for rid in ids}
        while ids:
            for rid in ids:
                rows[rid].extend(new[rid])
            buf = np.zeros((len(ids), width), np.int32)  # [B, width] vLLM's token rows
            for i, rid in enumerate(ids):
                buf[i, :len(rows[rid])] = rows[rid]
            input_batch = RunnerBatch(ids, [cfg.prompt_len] * len(ids), buf, [len(rows[r]) for r in ids])
            sampled = [new[r] for r in ids]
            if not suffix:
                prop.bind(SimpleNamespace(input_batch=input_batch, requests=requests))
            t0 = time.perf_counter()
            out = prop.propose(input_batch, sampled) if suffix else prop.propose_batch(input_batch, sampled)
            if step == 1 and len(ids) == batch:
                times.append(time.perf_counter() - t0)
            live = []
            for rid, draft in zip(ids, out):
                tr, g = truth[row_of[rid]], len(rows[rid]) - cfg.prompt_len
                a = 0
                while a < len(draft) and g + a < cfg.length and draft[a] == tr[g + a]:
                    a += 1
                new[rid] = tr[g:g + a + 1]
                if g + len(new[rid]) < cfg.length:
                    live.append(rid)
                else:
                    del requests[rid]  # finished: vLLM's runner drops it
                if suffix:  # counted as the drafter counts: an accepted token shows in the next call's row
                    drafted += len(draft)
                    accepted += a if rid in requests else 0
            ids = live
    if not suffix:
        drafted, accepted = prop.drafter.stats.drafted, prop.drafter.stats.accepted
    return {"batch": batch, "policy": policy["policy"], "host_ms_per_step": round(float(np.median(times)) * 1e3, 3),
            "steps_timed": len(times), "drafted": drafted, "accepted": accepted,
            "load_avg_1m": round(os.getloadavg()[0], 2)}


def policies(latency: Optional[Path], suffix: bool = True) -> list[dict]:
    """fixed k (every row drafts), das priced by `latency` (None: a GPU server's prior, dasrl.policy.GPU_LATENCY),
    and vLLM's `suffix` when `suffix` and arctic-inference imports. Plain vLLM runs no proposer."""
    from dasrl_lab.drafters.arctic import arctic_available

    das = {"policy": "das", "latency_floor": False} | ({"latency": str(latency)} if latency else {})
    return [{"policy": "fixed", "max_spec_factor": 0.0}, das] + (
        [{"policy": "suffix"}] if suffix and arctic_available() else [])


COLUMNS = [("batch", "B", "{}"), ("policy", "policy", "{}"), ("host_ms_per_step", "host ms/step", "{:.3f}"),
           ("drafted", "drafted", "{}"), ("accepted", "accepted", "{}"), ("load_avg_1m", "load", "{:.2f}")]


def register(app: typer.Typer, bench: typer.Typer) -> None:
    from rich.console import Console

    from dasrl_lab.cli_args import json_option, rows_table, user_errors, write_json_out
    from dasrl_lab.drafters.arctic import arctic_status

    @bench.command("proposer")
    def bench_proposer(
        batches: str = typer.Option("16,64,256,512", help="Comma-separated batch sizes (multiples of 4)."),
        latency: Optional[Path] = typer.Option(None, help="latency.json pricing das (default: the shipped "
                                                          "7B-H100 profile)."),
        repeats: int = typer.Option(3, min=1, help="Runs per (batch, policy); the table keeps the median."),
        suffix: bool = typer.Option(True, help="Time vLLM's `suffix` proposer too (needs arctic-inference: "
                                               "`make arctic-install`; left out, and said so, without it)."),
        json_out: Optional[Path] = json_option("Write the rows as JSON here."),
    ) -> None:
        """Host seconds per engine step of the vLLM proposer (no vLLM): fixed, das and vLLM's suffix, by batch
        size."""
        with user_errors():
            cfg = ProposerBenchConfig(batches=tuple(int(b) for b in batches.split(",")))
        rows, pols = [], policies(latency, suffix)
        console = Console()
        if suffix and not any(p["policy"] == "suffix" for p in pols):
            console.print(f"vLLM's suffix left out: arctic-inference does not import ({arctic_status()}); "
                          "`make arctic-install`")
        for b in cfg.batches:
            runs: list[list[dict]] = [[] for _ in pols]
            for r in range(repeats):  # the policies alternate, so that a change of load weighs on each alike
                for i, pol in enumerate(pols):
                    runs[i].append(run_one(cfg, b, pol, seed=r))
            for pol_runs in runs:
                best = sorted(pol_runs, key=lambda r: r["host_ms_per_step"])[len(pol_runs) // 2]
                rows.append(best | {"host_ms_repeats": [r["host_ms_per_step"] for r in pol_runs]})
        console.print(rows_table("dasrl bench proposer", rows, COLUMNS))
        write_json_out(json_out, rows, console)
