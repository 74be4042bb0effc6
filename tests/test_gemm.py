"""Row padding of CPU linear layers (dasrl.engine.gemm): which row counts are padded, the same products
for the real rows, and the model restored after the block."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dasrl.engine import gemm
from dasrl.engine.gemm import NO_PADDING, RowPadding, _linear, padded_linears


def test_target_band_by_hand():
    p = RowPadding(low=12, to=16)
    assert [p.target(m) for m in (1, 2, 11, 12, 13, 15, 16, 17, 100)] == [1, 2, 11, 16, 16, 16, 16, 17, 100]
    assert [NO_PADDING.target(m) for m in (1, 12, 15)] == [1, 12, 15]


@pytest.mark.parametrize("low, to", [(-1, 16), (16, 16), (17, 16)])
def test_bad_bands_are_refused(low, to):
    with pytest.raises(ValueError, match="row padding needs"):
        RowPadding(low=low, to=to)


def test_padded_linear_computes_the_real_rows(monkeypatch):
    torch.manual_seed(0)
    w, b = torch.randn(40, 24), torch.randn(40)
    x = torch.randn(1, 13, 24)  # [1, M, K]: the packed forward's shape
    seen = []
    real = F.linear

    def spy(inp, *args):  # records the rows the product was computed on, then computes it
        seen.append(inp.shape[0])
        return real(inp, *args)

    monkeypatch.setattr(gemm.F, "linear", spy)
    out = _linear(x, w, b, RowPadding(low=12, to=16))
    monkeypatch.undo()
    assert seen == [16] and out.shape == (1, 13, 40)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-6, atol=1e-5)
    assert torch.equal(out[0], F.linear(torch.cat([x[0], torch.zeros(3, 24)]), w, b)[:13])


def test_model_forward_inside_and_restored_after(tiny_llama):
    model = tiny_llama()
    ids = torch.arange(13)[None] % 97
    with torch.inference_mode():
        plain = model(input_ids=ids).logits
        with padded_linears(model, RowPadding(low=12, to=16)):
            patched = [m for m in model.modules() if "forward" in m.__dict__]
            padded = model(input_ids=ids).logits
        assert patched and all(type(m) is torch.nn.Linear for m in patched)
        assert not any("forward" in m.__dict__ for m in model.modules())  # restored
    torch.testing.assert_close(padded, plain, rtol=1e-5, atol=1e-5)


def test_restored_after_an_error_and_foreign_forwards_left_alone(tiny_llama):
    model = tiny_llama()
    head = model.lm_head
    head.forward = lambda x: F.linear(x, head.weight)  # another library's instance patch
    mine = head.forward
    with pytest.raises(RuntimeError, match="boom"):
        with padded_linears(model, RowPadding()):
            assert head.forward is mine
            raise RuntimeError("boom")
    assert head.forward is mine
    assert sum("forward" in m.__dict__ for m in model.modules()) == 1


@pytest.mark.skipif(not gemm.onednn_available(), reason="torch built without oneDNN")
def test_tuned_kernels_compute_every_linear_and_follow_weight_updates(tiny_llama):
    """LinearKernels: each row count's product is F.linear's (to float32 rounding) whichever kernel the
    timing chose, a kernel is chosen at every bucket, and every kind of weight change between two epochs
    is picked up (in place under no_grad, through .data -- which bumps no version counter, as peft's merge
    does --, a new tensor, a new Parameter): a stale reordered copy would silently compute with the old
    weights."""
    model = tiny_llama()
    kernels = gemm.LinearKernels(repeats=1)
    kernels.refresh(model)
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert len(kernels.choice) == len(linears)
    lin = linears[0]
    for rows in (1, 2, 5, 16, 200):
        x = torch.randn(1, rows, lin.in_features)
        torch.testing.assert_close(kernels.linear(lin, x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    x = torch.randn(7, lin.in_features)

    def changes():
        with torch.no_grad():
            lin.weight.mul_(-2.0)  # in place: the version moves
        yield
        v = lin.weight._version
        lin.weight.data += 0.5 * torch.randn_like(lin.weight)  # through .data: the version stays
        assert lin.weight._version == v
        yield
        lin.weight.data.copy_(torch.randn_like(lin.weight))
        yield
        lin.weight.data = torch.randn_like(lin.weight)  # a new storage under the same Parameter
        yield
        lin.weight = torch.nn.Parameter(torch.randn_like(lin.weight))  # a new Parameter
        yield

    for _ in changes():
        kernels.refresh(model)
        kernels.choice[id(lin)] = np.ones(len(kernels.buckets), bool)  # every bucket on the reordered copy
        torch.testing.assert_close(kernels.linear(lin, x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not gemm.onednn_available(), reason="torch built without oneDNN")
def test_engines_on_one_model_share_its_reordered_weights(tiny_llama):
    """A baseline and a speculative session on one model hold one reordered copy of its weights, not one
    each (a 1.5B model's copy is 6 GB); another model gets its own."""
    from dasrl.engine.engine import SpecEngine

    model, other = tiny_llama(), tiny_llama(seed=1)
    a, b, c = SpecEngine(model), SpecEngine(model), SpecEngine(other)
    assert a.kernels is b.kernels is not None and c.kernels is not a.kernels
