"""Shared fixtures (the library's tests and the lab's, tests/lab/): SmolLM2-135M-Instruct, loaded once per session
from the folder the lab converts from its embedded GGUF (smollm_path).

DASRL_BLOCK_LAB=1 makes `dasrl_lab` unimportable and leaves tests/lab/ uncollected: the library's tests alone,
as where the lab is not installed (`make test-lib`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

LAB_BLOCKED = os.environ.get("DASRL_BLOCK_LAB") == "1"
SMOLLM_ENV = "DASRL_SMOLLM"
"""The converted SmolLM2 folder's variable (make test-lib sets it)."""

if LAB_BLOCKED:
    from support import block_lab

    block_lab.install()
    collect_ignore = ["lab"]

CHAT_PROMPTS = [
    "What is 2+2?",
    "List three prime numbers.",
    "Explain gravity to a child in two sentences.",
    "Hi",
    "Translate 'good morning' into French and German.",
    "What is the capital of France? Answer in one word.",
    "Write a Python function that returns the square of a number, with a docstring.",
    "Name the planets of the solar system in order from the sun, separated by commas, and add one fact.",
]


TEST_THREADS = int(os.environ.get("DASRL_TEST_THREADS", "1"))
"""torch threads for the tests: 1 by default. On two shared cores two threads run several times slower than
one (and `make test` runs two workers side by side); exactness does not depend on it."""


@pytest.fixture(autouse=True)
def _torch_threads():
    """Every test starts at TEST_THREADS torch threads, whatever the test before it set (an engine built with
    num_threads=None keeps the host's count; the latency experiment sets every core)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != TEST_THREADS:
        torch.set_num_threads(TEST_THREADS)
    yield


# `make test` runs two pytest-xdist workers (-n 2 --dist loadfile): each file runs whole on one worker, its
# module and session fixtures built there once. The scheduler below keeps the files that start a local Ray
# cluster on one worker, one after the other, and hands out the longest files first, so that no long file
# starts last (LONGEST_FIRST: each file's seconds in a two-worker `make test` at load ~2 on two cores; the
# files not named take a few seconds each).
SAME_WORKER = {"tests/test_ray.py": "ray cluster", "tests/test_verl.py": "ray cluster"}
LONGEST_FIRST = {"tests/test_engine.py": 81, "ray cluster": 77, "tests/test_batch_invariance.py": 47,
                 "tests/test_session.py": 37, "tests/lab/test_sim.py": 35, "tests/test_trl.py": 34,
                 "tests/test_weight_fidelity.py": 34, "tests/lab/test_tasks.py": 22, "tests/test_install.py": 22,
                 "tests/test_trl_multiprocess.py": 20, "tests/test_counting.py": 18, "tests/test_corrupt_files.py": 15,
                 "tests/test_session_faults.py": 12, "tests/lab/test_whatif.py": 12, "tests/lab/test_experiments.py": 9,
                 "tests/test_stops.py": 9, "tests/lab/test_cli_flags.py": 8, "tests/lab/test_fidelity.py": 7,
                 "tests/test_sampling.py": 7, "tests/lab/test_gpu_check.py": 7}


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LongestFileFirst(LoadFileScheduling):
        def _split_scope(self, nodeid):
            scope = super()._split_scope(nodeid)
            return SAME_WORKER.get(scope, scope)

        def _assign_work_unit(self, node):
            longest = max(self.workqueue, key=lambda scope: LONGEST_FIRST.get(scope, 0))
            self.workqueue.move_to_end(longest, last=False)
            super()._assign_work_unit(node)

    return LongestFileFirst(config, log)


@pytest.fixture(scope="session")
def smollm_path() -> str:
    """SmolLM2-135M-Instruct as a Hugging Face folder (for the smollm and tiny_chat fixtures, Ray actors, child
    processes): $DASRL_SMOLLM, else the lab's converted copy, asked of the lab in a child process (`python -m
    dasrl_lab.models` converts the embedded GGUF once, caches it and prints the folder; the lab owns the
    conversion and the cache's place, and the library's tests import no lab module). With the lab blocked
    (`make test-lib`, a machine without the lab) the variable must name it."""
    folder = os.environ.get(SMOLLM_ENV)
    if not folder:
        if LAB_BLOCKED:
            pytest.fail(f"{SMOLLM_ENV} is not set: with the lab blocked, the library's tests load SmolLM2 from the "
                        f"folder it names (make test-lib sets it: python -m dasrl_lab.models)", pytrace=False)
        out = subprocess.run([sys.executable, "-m", "dasrl_lab.models"], capture_output=True, text=True)
        if out.returncode != 0:
            pytest.fail(f"python -m dasrl_lab.models could not give the SmolLM2 folder:\n{out.stderr}", pytrace=False)
        folder = out.stdout.strip().splitlines()[-1]
    return folder


@pytest.fixture(scope="session")
def smollm(smollm_path):
    """(model, tokenizer): SmolLM2-135M-Instruct in float32, eval mode (on CUDA when there is one)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm_path)
    model = AutoModelForCausalLM.from_pretrained(smollm_path, dtype=torch.float32)
    model.to("cuda" if torch.cuda.is_available() else "cpu").eval()
    _FINGERPRINT[id(model)] = _fingerprint(model)
    return model, tokenizer


_FINGERPRINT: dict[int, tuple] = {}
"""The shared smollm model's state when built: every test that uses it must leave it so (_smollm_unchanged)."""


def _fingerprint(model) -> tuple:
    """What a test could change in a shared model and see in its logits: every parameter and buffer (exact
    float64 sums), its configuration, its training flags, a forward replaced or hooked on any module."""
    import torch

    with torch.no_grad():
        tensors = tuple((name, str(t.dtype), tuple(t.shape), t.double().sum().item())
                        for name, t in [*model.named_parameters(), *model.named_buffers()])
    patched = tuple(name for name, m in model.named_modules()
                    if "forward" in m.__dict__ or m._forward_hooks or m._forward_pre_hooks)
    return (tensors, model.config.to_json_string(), model.config._attn_implementation,
            tuple(m.training for m in model.modules()), patched)


@pytest.fixture(autouse=True)
def _smollm_unchanged(request):
    """A test that changes the session-shared SmolLM2 (weights, buffers, config, mode) fails here, by name:
    a later test would otherwise see a different model and fail far from the cause."""
    yield
    if "smollm" in request.fixturenames and _FINGERPRINT:
        model = request.getfixturevalue("smollm")[0]
        assert _fingerprint(model) == _FINGERPRINT[id(model)], \
            f"{request.node.nodeid} changed the session-shared smollm model (weights, buffers, config or mode)"


@pytest.fixture(scope="session")
def chat_prompts(smollm):
    """Eight chat-formatted prompts of different lengths, as token-id lists."""
    _, tok = smollm
    out = []
    for text in CHAT_PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    assert len(out) == 8 and len({len(p) for p in out}) == 8
    return out


@pytest.fixture(scope="session")
def tiny_chat(tmp_path_factory, smollm_path):
    """(model, tokenizer, folder): a tiny random Llama (2 layers, hidden 64, grouped-query heads 4/2) over
    SmolLM2's tokenizer and chat template, SmolLM2's configuration otherwise (vocabulary, special tokens, tied
    head, context), saved as a model folder. Its final norm is scaled x8: at T = 0.6 its samples repeat enough
    that drafts from a prompt's history are accepted about half the time (at x1, never). For the
    tests of what does not depend on the weights (the simulator's replay, a resumed trainer's seeds, Ray
    workers) at a small fraction of the real model's cost; the exactness properties are checked on SmolLM2
    itself (test_engine.py and others)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    real = smollm_path
    config = AutoConfig.from_pretrained(real)
    config.update(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        model.model.norm.weight.mul_(8)
    tokenizer = AutoTokenizer.from_pretrained(real)
    folder = tmp_path_factory.mktemp("tiny-chat")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model, tokenizer, folder


def _tiny(family: str):
    """A factory of small random models of a transformers family (vocab 97, 2 layers, grouped-query heads 4/2),
    seeded: each call builds a fresh model in eval mode, so a test may change its weights."""
    torch = pytest.importorskip("torch")
    import transformers

    config_cls, model_cls = (getattr(transformers, f"{family}{suffix}") for suffix in ("Config", "ForCausalLM"))

    def make(seed: int = 0):
        torch.manual_seed(seed)
        cfg = config_cls(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
        return model_cls(cfg).eval()
    return make


@pytest.fixture(scope="session")
def tiny_llama():
    """Small random Llama models (_tiny)."""
    return _tiny("Llama")


@pytest.fixture(scope="session")
def tiny_qwen2():
    """Small random Qwen2 models (_tiny; Qwen2: biased q/k/v projections, full attention in every layer)."""
    return _tiny("Qwen2")
