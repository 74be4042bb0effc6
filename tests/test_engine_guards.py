"""Issue 26: the engine refuses what it would get wrong, and a failed generate leaves nothing behind.

- construction probe: the packed forward's logits must be the model's own (a layer that drops
  `dasrl_packed`, or attention without the causal mask, is refused naming the model type);
- sliding-window models are refused; attention raises instead of falling back;
- any error in generate (KeyboardInterrupt included) aborts the live requests in the drafter and the
  policy: a retry succeeds and equals a clean run, and nothing partial is indexed or learnt;
- EngineConfig refuses bad values.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaDecoderLayer  # noqa: E402

import dasrl.engine.attention as attention  # noqa: E402
from dasrl.engine.compat import cache_keyword  # noqa: E402
from dasrl.drafter.base import DrafterBase  # noqa: E402
from dasrl.drafter.store import DraftStore, StoreConfig  # noqa: E402
from dasrl.engine.engine import EngineConfig, EngineStepError, SpecEngine, UnsupportedModel  # noqa: E402
from dasrl.engine.sampling import SamplingParams  # noqa: E402
from dasrl.policy.allowance import ClassCaps, ForwardAllowance  # noqa: E402

SIZES = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


def build(config_cls, model_cls, seed=0, **kw):
    torch.manual_seed(seed)
    return model_cls(config_cls(**SIZES, **kw)).eval()


# ----------------------------------------------------------------------------- which models run


def test_llama_and_qwen2_pass_the_probe_and_decode_as_the_model_does():
    for model in (build(LlamaConfig, LlamaForCausalLM), build(Qwen2Config, Qwen2ForCausalLM)):
        engine = SpecEngine(model)
        prompt = [5, 9, 14, 3, 77]
        out = engine.generate([prompt], sampling=SamplingParams(temperature=0.0), max_new_tokens=8, ignore_eos=True)
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
        assert out[0].token_ids == ref[0, len(prompt):].tolist()


def test_the_cache_keyword_is_the_one_the_decoder_forward_names(monkeypatch):
    """transformers renamed the decoder's KV cache argument (past_key_values -> cache in 5.24); a name the
    forward does not declare falls into **kwargs and reaches attention unused (issue 42, on 5.19). The engine
    reads it from the forward's signature, and refuses a decoder that names neither."""
    from packaging.version import Version

    model = build(LlamaConfig, LlamaForCausalLM)
    new = Version(transformers.__version__).release >= (5, 24)
    assert cache_keyword(model.get_decoder()) == ("cache" if new else "past_key_values")
    assert SpecEngine(model)._cache_kw == cache_keyword(model.get_decoder())
    monkeypatch.setattr(model.model, "forward", lambda input_ids=None, attention_mask=None, **kwargs: None)
    with pytest.raises(UnsupportedModel, match=r"model type 'llama'.*none of \['cache', 'past_key_values'\]"):
        SpecEngine(model)


@pytest.mark.parametrize("make", [
    lambda: build(Qwen2Config, Qwen2ForCausalLM, use_sliding_window=True, sliding_window=16, max_window_layers=1),
    lambda: build(MistralConfig, MistralForCausalLM, sliding_window=32),
], ids=["qwen2-sliding", "mistral"])
def test_sliding_window_models_are_refused_naming_the_model_type(make):
    model = make()
    with pytest.raises(UnsupportedModel, match=rf"model type '{model.config.model_type}'.*sliding_window="):
        SpecEngine(model)


class DropsPackedLayout(LlamaDecoderLayer):
    """A decoder layer that does not pass the engine's keyword argument on (as a custom layer might)."""

    def forward(self, *args, **kwargs):
        kwargs.pop("dasrl_packed", None)
        return super().forward(*args, **kwargs)


def test_probe_refuses_a_layer_that_drops_the_packed_layout():
    model = build(LlamaConfig, LlamaForCausalLM)
    old = model.model.layers[1]
    layer = DropsPackedLayout(model.config, 1)
    layer.load_state_dict(old.state_dict())
    model.model.layers[1] = layer.eval()
    with pytest.raises(UnsupportedModel, match=r"model type 'llama'.*without the packed layout"):
        SpecEngine(model)


def test_probe_refuses_attention_that_ignores_the_causal_mask(monkeypatch):
    """The failure the issue feared: attention over every new token with no causal mask among them. Plain and
    speculative outputs would be equally wrong; the probe compares with the model's own forward instead."""
    real = attention._packed_attention

    def unmasked(query, key, value, layout, scaling):
        return real(query, key, value, dataclasses.replace(layout, more_mask=torch.ones_like(layout.more_mask)),
                    scaling)

    model = build(LlamaConfig, LlamaForCausalLM)
    SpecEngine(model)  # the real attention passes
    monkeypatch.setattr(attention, "_packed_attention", unmasked)
    with pytest.raises(UnsupportedModel, match=r"model type 'llama'.*logits differ"):
        SpecEngine(model)


def test_attention_raises_instead_of_falling_back():
    q, kv = torch.zeros(1, 4, 3, 16), torch.zeros(2, 2, 8, 16)
    module = torch.nn.Identity()
    with pytest.raises(attention.ModelInRollout, match="not the rollout's"):  # no engine forward on this thread
        attention._engine_attention(module, q, kv, kv, None, scaling=0.25)
    with attention.engine_thread(), pytest.raises(attention.PackedLayoutMissing, match="without the packed layout"):
        attention._engine_attention(module, q, kv, kv, None, scaling=0.25)
    with pytest.raises(NotImplementedError, match=r"\['softcap'\]"):
        attention._engine_attention(module, q, kv, kv, None, scaling=0.25, dasrl_packed=object(), softcap=30.0)


# ---------------------------------------------------------------------------- failed generates


class Interrupting(DrafterBase):
    """Fault injection: a DraftStore whose propose raises `error` on its `at`-th call (once)."""

    def __init__(self, store: DraftStore, at: int, error: BaseException) -> None:
        self.store, self.at, self.error, self.calls = store, at, error, 0

    def start(self, req_id, problem_id, prompt_ids):
        self.store.start(req_id, problem_id, prompt_ids)

    def propose(self, req_ids, budgets):
        self.calls += 1
        if self.calls == self.at:
            raise self.error
        return self.store.propose(req_ids, budgets)

    def observe(self, req_id, tokens):
        self.store.observe(req_id, tokens)

    def finish(self, req_id):
        self.store.finish(req_id)

    def abort(self, req_id):
        self.store.abort(req_id)

    def end_step(self):
        self.store.end_step()


PROMPTS = [[3, 5, 7, 11], [2, 4, 6, 8, 10, 12], [1, 1, 2, 3, 5]]


def run(engine, drafter, policy):
    return engine.generate(PROMPTS, seeds=[10, 11, 12], sampling=SamplingParams(temperature=1.0), drafter=drafter,
                           policy=policy, max_new_tokens=12, ignore_eos=True, req_ids=[(0, i) for i in range(3)],
                           problem_ids=["a", "b", "c"])


@pytest.mark.parametrize("make_error", [KeyboardInterrupt, lambda: ValueError("injected")], ids=["KeyboardInterrupt", "error"])
def test_a_failed_generate_aborts_its_requests_and_a_retry_equals_a_clean_run(make_error):
    # A fresh exception per test: a raised exception keeps its traceback, and one made at import time (a
    # parametrize value) would keep this test's frames -- stores and all -- alive until interpreter exit,
    # after nanobind's leak check.
    error = make_error()
    engine = SpecEngine(build(LlamaConfig, LlamaForCausalLM))
    clean_store, clean_policy = DraftStore(StoreConfig()), ForwardAllowance(ClassCaps(), 64)
    clean = run(engine, clean_store, clean_policy)
    assert all(c.finish_reason == "length" for c in clean)

    store, policy = DraftStore(StoreConfig()), ForwardAllowance(ClassCaps(), 64)
    faulty = Interrupting(store, at=3, error=error)
    with pytest.raises(type(error) if isinstance(error, KeyboardInterrupt) else EngineStepError):
        run(engine, faulty, policy)
    policy.end_step()  # a policy that still tracked the partial rows would learn their lengths here
    assert policy.lengths.num_problems == 0
    store.end_step()  # nothing partial was indexed: an aborted request leaves no rollout behind
    assert store.num_tokens == 0

    retry = run(engine, faulty, policy)  # "request (0, 0) already started" before the fix
    assert [c.token_ids for c in retry] == [c.token_ids for c in clean]
    assert [c.logprobs for c in retry] == [c.logprobs for c in clean]
    for s in (store, clean_store):
        s.end_step()
    assert store.num_tokens == clean_store.num_tokens


# ---------------------------------------------------------------------------------- config


@pytest.mark.parametrize("kw, field", [
    (dict(initial_capacity=-100), "initial_capacity"),
    (dict(initial_capacity=1.5), "initial_capacity"),
    (dict(initial_capacity="64"), "initial_capacity"),
    (dict(max_context=1), "max_context"),
    (dict(num_threads=0), "num_threads"),
    (dict(num_threads=True), "num_threads"),
    (dict(batch_invariant=1), "batch_invariant"),
    (dict(row_padding=16), "row_padding"),
])
def test_engine_config_refuses_bad_values_naming_them(kw, field):
    with pytest.raises((ValueError, TypeError), match=rf"{field}.*{kw[field]!r}".replace("(", r"\(")):
        EngineConfig(**kw)
    assert EngineConfig(initial_capacity=0).initial_capacity == 0  # the cache grows as needed


# ---------------------------------------------------------------------------------- process-wide state

def test_torch_threads_are_left_alone_unless_asked():
    """EngineConfig(num_threads=None) leaves torch's thread count as the host set it (the engine used to
    set every core this process may use); an explicit num_threads is applied."""
    from dasrl.engine.engine import default_threads

    before = torch.get_num_threads()
    mine = default_threads() + 1  # what the old default would have overwritten
    try:
        torch.set_num_threads(mine)
        SpecEngine(build(LlamaConfig, LlamaForCausalLM))
        assert torch.get_num_threads() == mine
        SpecEngine(build(LlamaConfig, LlamaForCausalLM), config=EngineConfig(num_threads=1))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


class PatchSpy(Interrupting):
    """Records, at the failing propose (mid-generate), whose Linear layers carry the padding patch."""

    def __init__(self, store, engine_model, other_model):
        super().__init__(store, at=2, error=ValueError("injected"))
        self.models, self.seen = (engine_model, other_model), None

    def propose(self, req_ids, budgets):
        if self.calls + 1 == self.at:
            self.seen = [sum("forward" in m.__dict__ for m in model.modules() if isinstance(m, torch.nn.Linear))
                         for model in self.models]
        return super().propose(req_ids, budgets)


def test_linear_padding_is_scoped_to_the_engines_model_and_undone_on_error():
    """The linear patch (tuned kernels, or MKL's row padding) replaces forward on the engine model's own
    nn.Linear instances during generate() only: the class, and every other model, are untouched, and an
    exception mid-generate undoes it."""
    class_forward = torch.nn.Linear.forward
    model, other = build(LlamaConfig, LlamaForCausalLM), build(LlamaConfig, LlamaForCausalLM, seed=1)
    engine = SpecEngine(model)
    assert engine.kernels is not None or engine.row_padding.low  # the patch is in play
    spy = PatchSpy(DraftStore(StoreConfig()), model, other)
    with pytest.raises(EngineStepError):
        run(engine, spy, ForwardAllowance(ClassCaps(), 64))
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert spy.seen == [linears, 0]  # mid-generate: every engine Linear patched, none of the other model
    assert torch.nn.Linear.forward is class_forward
    assert not any("forward" in m.__dict__ for m in model.modules())
    x = torch.randn(3, SIZES["hidden_size"])
    lin = next(m for m in other.modules() if isinstance(m, torch.nn.Linear))
    assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))
