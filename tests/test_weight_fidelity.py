"""Rollouts follow the trainer's weights: whatever the trainer did to the model between two generate()
calls, a session's completions are those of a fresh session on a deep copy of the model as it is now
(token for token; logprobs to float noise), and greedy ones are HF `generate`'s.

The fidelity matrix runs on a tiny random Llama with every linear forced onto the engine's reordered
weight copies (gemm.LinearKernels), so a stale copy could not hide behind MKL's choice; the last test
repeats the changes the reliability probe found on the real SmolLM2.
"""

from __future__ import annotations

import copy
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from dasrl.engine import EngineConfig, gemm  # noqa: E402
from dasrl.engine.attention import ModelInRollout  # noqa: E402
from dasrl.engine.sampling import SamplingParams  # noqa: E402
from dasrl.rollout import RolloutSession, SessionConfig  # noqa: E402

GREEDY, T1 = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)
NEW = 16
SEEDS = [11, 12, 13, 14, 15, 16]


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, 97, size=n).tolist() for n in (5, 9, 3, 12, 7, 4)]


def _linears(model) -> list[torch.nn.Linear]:
    return [m for m in model.modules() if type(m) is torch.nn.Linear]


def _lora(model, sign: float) -> None:
    """A LoRA merge (+1) or unmerge (-1) the way peft's lora.Linear does it: W.data += scale * B @ A."""
    g = torch.Generator().manual_seed(5)
    for layer in model.model.layers:
        for lin in (layer.self_attn.q_proj, layer.self_attn.v_proj):
            a = torch.randn(4, lin.in_features, generator=g)
            b = torch.randn(lin.out_features, 4, generator=g)
            lin.weight.data += sign * 0.5 * (b @ a)


def _adamw(model) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    model.train()
    ids = torch.tensor([_prompts()[3]])
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def _load_other(model, tiny_llama) -> None:
    model.load_state_dict(tiny_llama(seed=3).state_dict())


def _in_place(model) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1.3)


def _vector(model) -> None:
    vec = torch.nn.utils.parameters_to_vector(model.parameters())
    torch.nn.utils.vector_to_parameters(vec * 1.5 + 0.01, model.parameters())


def _noise_data(model) -> None:  # the reliability probe's repro
    for p in _linears(model):
        p.weight.data += 0.3 * p.weight.data.std() * torch.randn(p.weight.shape)


def _new_head(model) -> None:
    old = model.lm_head
    head = torch.nn.Linear(old.in_features, old.out_features, bias=False)
    model.lm_head = head


def _set_output(model) -> None:
    old = model.get_output_embeddings()
    head = torch.nn.Linear(old.in_features, old.out_features, bias=False)
    model.set_output_embeddings(head)


def _new_down(model) -> None:
    layer = model.model.layers[1]
    old = layer.mlp.down_proj
    layer.mlp.down_proj = torch.nn.Linear(old.in_features, old.out_features, bias=False)


def _bf16_round_trip(model) -> None:
    model.to(torch.bfloat16)
    model.to(torch.float32)


CHANGES = {
    "adamw step": lambda m, t: _adamw(m),
    "load_state_dict": _load_other,
    "in place under no_grad": lambda m, t: _in_place(m),
    "data.copy_": lambda m, t: [p.data.copy_(torch.randn_like(p)) for p in _linears(m) for p in (p.weight,)],
    "data = tensor": lambda m, t: [setattr(p.weight, "data", torch.randn_like(p.weight)) for p in _linears(m)],
    "data += noise": lambda m, t: _noise_data(m),
    "lora merge via .data": lambda m, t: _lora(m, +1.0),
    "lora merge then unmerge": lambda m, t: (_lora(m, +1.0), _noise_data(m), _lora(m, -1.0)),
    "vector_to_parameters": lambda m, t: _vector(m),
    "embedding .data edit": lambda m, t: m.get_input_embeddings().weight.data.mul_(-1.0),
    "new Parameter": lambda m, t: [setattr(p, "weight", torch.nn.Parameter(torch.randn_like(p.weight)))
                                   for p in _linears(m)],
    "bf16 and back": lambda m, t: _bf16_round_trip(m),
    "replaced lm_head": lambda m, t: _new_head(m),
    "set_output_embeddings": lambda m, t: _set_output(m),
    "resize_token_embeddings": lambda m, t: m.resize_token_embeddings(105),
    "replaced decoder Linear": lambda m, t: _new_down(m),
}


@pytest.fixture
def onednn_everywhere(monkeypatch):
    """Every float32 linear computed by oneDNN over the engine's reordered copy, at every row count."""
    if not gemm.onednn_available():
        pytest.skip("torch built without oneDNN")
    monkeypatch.setattr(gemm.LinearKernels, "_choice", lambda self, m, *_: np.ones(len(self.buckets), bool))


def _generate(session, sampling):
    return session.generate(_prompts(), seeds=SEEDS, sampling=sampling, max_new_tokens=NEW)


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_rollouts_follow_the_weights(change, tiny_llama, onednn_everywhere):
    torch.manual_seed(0)
    model = tiny_llama()
    config = SessionConfig(counting=False, engine=EngineConfig(num_threads=1))
    das = RolloutSession(model, None, config)
    plain = RolloutSession(model, None, SessionConfig(speculate=False, counting=False))
    for _ in range(2):  # history to draft from, reordered copies made, the kernels bound
        for s in (das, plain):
            _generate(s, GREEDY)
            s.end_step()
    model.train()  # as a trainer leaves it
    CHANGES[change](model, tiny_llama)
    fresh = RolloutSession(copy.deepcopy(model), None, SessionConfig(speculate=False, counting=False))
    drafted = 0
    greedy = _generate(fresh, GREEDY)
    for sampling in (GREEDY, T1):
        want = greedy if sampling is GREEDY else _generate(fresh, sampling)
        for s in (das, plain):
            got = _generate(s, sampling)
            assert [r.completion_ids for r in got] == [r.completion_ids for r in want], (change, sampling)
            np.testing.assert_allclose(np.concatenate([r.logprobs for r in got]),
                                       np.concatenate([r.logprobs for r in want]), atol=1e-4)
            drafted += sum(r.drafted for r in got) if s is das else 0
    assert model.training, "the trainer's train mode is restored"
    model.eval()
    with torch.inference_mode():
        for p, r in zip(_prompts(), greedy):
            hf = model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                                attention_mask=torch.ones(1, len(p), dtype=torch.long))[0, len(p):].tolist()
            assert r.completion_ids == hf[: len(r.completion_ids)], change
    assert drafted > 0, "the speculating session drafted: its multi-token forwards were compared too"
    for s in (das, plain, fresh):
        s.close()


def test_batch_invariant_logprobs_equal_exactly_after_a_change(tiny_llama):
    """In batch-invariant mode a changed model's logprobs equal a fresh session's bit for bit."""
    model = tiny_llama()
    config = SessionConfig(counting=False, engine=EngineConfig(batch_invariant=True, num_threads=1))
    das = RolloutSession(model, None, config)
    _generate(das, T1)
    das.end_step()
    _noise_data(model)
    _new_head(model)
    fresh = RolloutSession(copy.deepcopy(model), None, SessionConfig(speculate=False, counting=False,
                                                                      engine=config.engine))
    got, want = _generate(das, T1), _generate(fresh, T1)
    assert [r.completion_ids for r in got] == [r.completion_ids for r in want]
    assert [r.logprobs for r in got] == [r.logprobs for r in want]


def test_a_forward_from_another_thread_during_a_rollout_is_refused_by_name(tiny_llama):
    """The trainer's forward on another thread while generate() holds the model: a clear error naming the
    cause (not a layer of the model), and the rollout itself unharmed."""
    model = tiny_llama()
    session = RolloutSession(model, None, SessionConfig(speculate=False, counting=False))
    want = _generate(session, GREEDY)
    errors: list[BaseException] = []
    started = threading.Event()

    def trainer():
        started.wait()
        try:
            model(input_ids=torch.tensor([[5, 6, 7]]))
        except BaseException as e:  # noqa: BLE001 - collected for the assertion below
            errors.append(e)

    t = threading.Thread(target=trainer)
    t.start()

    def on_step(info):
        if info.step == 2:
            started.set()
            t.join()

    got = session.generate(_prompts(), seeds=SEEDS, sampling=GREEDY, max_new_tokens=NEW, on_step=on_step)
    assert [r.completion_ids for r in got] == [r.completion_ids for r in want]
    assert len(errors) == 1 and isinstance(errors[0], ModelInRollout), errors
    assert "model_lock" in str(errors[0])
    model(input_ids=torch.tensor([[5, 6, 7]]))  # after generate() the model is the trainer's again


@pytest.mark.slow
def test_real_model_follows_data_writes_head_and_dtype(smollm, chat_prompts):
    """The probe's repros on SmolLM2: writes through .data (peft's merge), a replaced head, a move to bf16
    and back; each time the session equals HF greedy and a fresh session, and nothing blames the model."""
    base, tok = smollm
    model = copy.deepcopy(base)
    prompts = chat_prompts[:2]
    das = RolloutSession(model, tok, SessionConfig(engine=EngineConfig(num_threads=1)))
    plain = RolloutSession(model, tok, SessionConfig(speculate=False, engine=EngineConfig(num_threads=1)))

    def hf(m):
        with torch.inference_mode():
            return [m.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                               attention_mask=torch.ones(1, len(p), dtype=torch.long))[0, len(p):].tolist()
                    for p in prompts]

    torch.manual_seed(0)
    steps = [lambda: _noise_data(model), lambda: _new_head(model) or model.lm_head.weight.data.copy_(
        base.lm_head.weight.data + 0.01 * torch.randn_like(base.lm_head.weight)),
        lambda: _bf16_round_trip(model)]
    for s in (das, plain):
        s.generate(prompts, max_new_tokens=12, sampling=GREEDY)
        s.end_step()
    for change in steps:
        change()
        want = hf(model)
        for s in (das, plain):
            got = s.generate(prompts, max_new_tokens=12, sampling=GREEDY)
            assert [r.completion_ids for r in got] == [w[: len(r.completion_ids)] for r, w in zip(got, want)]
            s.end_step()
    model.to(torch.bfloat16)  # the probe's item 3: oneDNN's primitive was made for fp32
    fresh = RolloutSession(copy.deepcopy(model), tok, SessionConfig(speculate=False))
    got = plain.generate(prompts, max_new_tokens=12, sampling=GREEDY, seeds=[1, 2])
    want = fresh.generate(prompts, max_new_tokens=12, sampling=GREEDY, seeds=[1, 2])
    assert [r.completion_ids for r in got] == [r.completion_ids for r in want]
    for s in (das, plain, fresh):
        s.close()
