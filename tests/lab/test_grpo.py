"""The GRPO update (dasrl_lab/demo/grpo.py) against the plain algorithm: micro-batches in the given order, full
logits over every position, log_softmax, gather of the completion tokens, the same token-mean loss. The
update groups sequences by length, runs the head only where a completion token is predicted and writes the
head's gradient by hand; the loss is a sum over sequences, so both must give the same loss, gradients and
AdamW step up to float rounding."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dasrl_lab.demo.grpo import GRPOConfig, GRPOTrainer, micro_batches  # noqa: E402


def reference_step(model, prompts, completions, adv, *, lr: float, train_layers: int, micro_batch: int) -> float:
    """The old GRPOTrainer.step, written plainly: returns the loss; leaves .grad on the trained parameters."""
    layers = model.get_decoder().layers
    for p in model.parameters():
        p.requires_grad_(False)
    params = [p for m in list(layers[-train_layers:]) + [model.get_decoder().norm] for p in m.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr)
    model.train()
    n_tokens = max(1, sum(len(c) for c in completions))
    total = 0.0
    opt.zero_grad()
    for s in range(0, len(prompts), micro_batch):
        idx = range(s, min(s + micro_batch, len(prompts)))
        seqs = [list(prompts[i]) + list(completions[i]) for i in idx]
        width = max(map(len, seqs))
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        for j, sq in enumerate(seqs):
            ids[j, : len(sq)] = torch.tensor(sq)
            mask[j, : len(sq)] = 1
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), -1)  # [b, L, V]
        loss = torch.zeros(())
        for j, i in enumerate(idx):
            p, c = len(prompts[i]), len(completions[i])
            if c == 0:
                continue
            lp = logp[j, p - 1: p - 1 + c].gather(-1, torch.tensor(completions[i])[:, None]).squeeze(-1)
            loss = loss - float(adv[i]) * lp.sum() / n_tokens
        if loss.requires_grad:  # a micro-batch of empty completions only has no loss (the old code raised)
            loss.backward()
        total += float(loss.detach())
    opt.step()
    model.eval()
    return total


def _batch(vocab: int = 97):
    """Very different lengths (1 to 180 completion tokens, prompts of 1 to 30), two empty completions."""
    rng = np.random.default_rng(7)
    p_lens = [12, 3, 30, 1, 8, 20, 5, 17, 9, 2, 25]
    c_lens = [180, 0, 7, 60, 1, 0, 2, 120, 33, 90, 4]
    prompts = [rng.integers(0, vocab, n).tolist() for n in p_lens]
    completions = [rng.integers(0, vocab, n).tolist() for n in c_lens]
    adv = rng.normal(size=len(prompts))
    return prompts, completions, adv


def _trained(model, train_layers):
    """(name, parameter) of the top `train_layers` decoder layers and the final norm."""
    d = model.get_decoder()
    return [(f"{k}.{n}", p) for k, m in enumerate(list(d.layers[-train_layers:]) + [d.norm])
            for n, p in m.named_parameters()]


@pytest.mark.parametrize("train_layers", [1, 2])
def test_step_matches_the_plain_algorithm(tiny_llama, train_layers):
    prompts, completions, adv = _batch()
    # AdamW's first step is lr * g / (|g| + eps): for gradients near eps (1e-8) it turns their rounding into
    # an update difference of order lr, so the parameter check uses an lr (1e-4, demo: 1e-5) well above atol
    # while the gradients themselves are checked tightly.
    lr = 1e-4
    ref_model, new_model = tiny_llama(3), tiny_llama(3)
    before = {n: p.detach().clone() for n, p in _trained(ref_model, train_layers)}
    ref_loss = reference_step(ref_model, prompts, completions, adv, lr=lr, train_layers=train_layers, micro_batch=4)
    # Different splits: 4 in the given order vs length-sorted groups of <= 3 under 200 padded tokens, and the
    # head in chunks of 7 positions, so chunks cut across sequences.
    trainer = GRPOTrainer(new_model, GRPOConfig(lr=lr, train_layers=train_layers, micro_batch=3, micro_tokens=200,
                                                head_chunk=7))
    groups = micro_batches([len(p) + len(c) - 1 for p, c in zip(prompts, completions) if c], 3, 200)
    assert len(groups) > 1 and max(map(len, groups)) > 1
    new_loss = trainer.step(prompts, completions, adv)
    assert new_loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    assert abs(ref_loss) > 1e-3
    ref, new = dict(_trained(ref_model, train_layers)), dict(_trained(new_model, train_layers))
    assert len(ref) == 9 * train_layers + 1
    for n in ref:
        g_ref, g_new = ref[n].grad, new[n].grad
        assert g_ref.abs().max() > 0, n
        assert torch.allclose(g_new, g_ref, rtol=1e-5, atol=1e-7), (n, (g_new - g_ref).abs().max())
        assert not torch.equal(ref[n], before[n]), n  # the step moved it
        assert torch.allclose(new[n], ref[n], rtol=1e-5, atol=1e-6), (n, (new[n] - ref[n]).abs().max())
    # The frozen rest is untouched.
    fresh = dict(tiny_llama(3).named_parameters())
    for n, p in new_model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, fresh[n]), n
    assert not new_model.training


def test_empty_completions_only(tiny_llama):
    model = tiny_llama(1)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = GRPOTrainer(model, GRPOConfig(lr=1e-3))
    assert trainer.step([[1, 2, 3], [4]], [[], []], np.array([1.0, -1.0])) == 0.0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_bad_input_is_named(tiny_llama):
    trainer = GRPOTrainer(tiny_llama(1), GRPOConfig())
    with pytest.raises(ValueError, match="empty prompt"):
        trainer.step([[], [1]], [[5, 6], [7]], np.array([1.0, -1.0]))
    with pytest.raises(ValueError, match="one prompt, completion and advantage"):
        trainer.step([[1]], [[5, 6], [7]], np.array([1.0, -1.0]))


def test_micro_batches_by_hand():
    # Longest first (ties in input order): 9(1) 9(3) 7(5) 5(0) 3(4) 2(2). Budget 20 tokens, <= 3 sequences:
    # [1, 3] (2 x 9 = 18; a third would make 27), [5, 0] (2 x 7 = 14; 3 x 7 = 21), [4, 2] (2 x 3).
    assert micro_batches([5, 9, 2, 9, 3, 7], max_seqs=3, max_tokens=20) == [[1, 3], [5, 0], [4, 2]]
    # A sequence over the budget goes alone; the count cap holds when the budget would allow more.
    assert micro_batches([30, 4, 4], max_seqs=8, max_tokens=10) == [[0], [1, 2]]
    assert micro_batches([1, 1, 1, 1, 1], max_seqs=2, max_tokens=100) == [[0, 1], [2, 3], [4]]
    assert micro_batches([], max_seqs=2, max_tokens=100) == []
    with pytest.raises(ValueError, match="max_tokens=0"):
        micro_batches([3], max_seqs=2, max_tokens=0)


def test_logprobs_match_the_plain_algorithm(tiny_llama):
    """GRPOTrainer.logprobs (the demo's KL probe) = log_softmax of the full model's logits at each position
    that predicts a completion token, end to end in input order, empty completions skipped; small
    micro-batches and head chunks so that the grouping and the chunking are exercised."""
    model = tiny_llama()
    prompts, completions, _ = _batch()
    trainer = GRPOTrainer(model, GRPOConfig(micro_batch=3, micro_tokens=200, head_chunk=50))
    want = []
    with torch.no_grad():
        for p, c in zip(prompts, completions):
            if c:
                logp = torch.log_softmax(model(input_ids=torch.tensor([p + c])).logits.float(), -1)[0]
                want.append(logp[len(p) - 1: len(p) - 1 + len(c)].gather(-1, torch.tensor(c)[:, None]).squeeze(-1))
    got = trainer.logprobs(prompts, completions)
    assert got.shape == (sum(map(len, completions)),)
    np.testing.assert_allclose(got, torch.cat(want).numpy(), rtol=1e-5, atol=1e-5)
