"""A real trl.GRPOTrainer for 2 steps on SmolLM2 with dasrl rollouts: DAS completions (and rewards) are
identical to the same run with speculation off."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.slow


def _run(tmp_path, smollm, *, speculate: bool) -> list[list[int]]:
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    import copy

    from dasrl.integrations.trl import dasrl_rollout

    model, tok = smollm
    model = copy.deepcopy(model)  # each run trains its own copy from the same weights
    seen: list[list[int]] = []

    def reward(completions, completion_ids, **kw):
        seen.extend(list(c) for c in completion_ids)
        return [float(len(c) % 7) / 7 for c in completion_ids]  # varied, so GRPO has a signal

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    ds = datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": q}] for q in
                                                ("What is 3+4?", "Name a color.", "Say hi.", "Count to 5.")]})
    args = trl.GRPOConfig(output_dir=str(tmp_path / f"out-{speculate}"), per_device_train_batch_size=4,
                          num_generations=4, max_completion_length=20, max_steps=2, learning_rate=1e-5,
                          bf16=False, gradient_checkpointing=False, use_cpu=True, report_to="none", seed=0,
                          logging_steps=1, save_strategy="no", temperature=0.8, dataloader_num_workers=0)
    trainer = trl.GRPOTrainer(model=model, processing_class=tok, reward_funcs=[reward], args=args,
                              train_dataset=ds, rollout_func=dasrl_rollout(speculate=speculate, policy="das"))
    trainer.train()
    return seen


def test_grpo_trainer_das_equals_plain(tmp_path, smollm):
    plain = _run(tmp_path, smollm, speculate=False)
    das = _run(tmp_path, smollm, speculate=True)
    assert len(plain) == 8 and das == plain


def test_logprobs_are_what_trl_compares(tmp_path, smollm):
    """The rollout's logprobs are the sampling distribution's at the trainer's temperature (vLLM's
    processed_logprobs), i.e. TRL's own log_softmax(logits / T) of the weights that generated them; a
    sampling setting the engine does not apply is refused."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    import copy

    import torch

    from dasrl.integrations.trl import dasrl_rollout

    model, tok = smollm
    before = copy.deepcopy(model)
    got: dict = {}
    rollout = dasrl_rollout(speculate=False)

    def capture(prompts, trainer):
        got.update(rollout(prompts, trainer))
        return got

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    ds = datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": "Name a fruit."}]]})

    def args(name, **kw):
        return trl.GRPOConfig(output_dir=str(tmp_path / name), per_device_train_batch_size=2, num_generations=2,
                              max_completion_length=10, max_steps=1, bf16=False, gradient_checkpointing=False,
                              use_cpu=True, report_to="none", seed=0, save_strategy="no", temperature=0.7, **kw)

    def reward(completion_ids, **kw):
        return [float(len(c)) for c in completion_ids]

    trl.GRPOTrainer(model=copy.deepcopy(model), processing_class=tok, reward_funcs=[reward], args=args("a"),
                    train_dataset=ds, rollout_func=capture).train()
    assert len(got["logprobs"]) == 2
    for p, c, lp in zip(got["prompt_ids"], got["completion_ids"], got["logprobs"]):
        with torch.no_grad():
            logits = before(torch.tensor([p + c])).logits[0, len(p) - 1: -1].double() / 0.7
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(c)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(lp, dtype=torch.float64), want, atol=1e-3), (lp, want.tolist())
    with pytest.raises(ValueError, match="min_p"):
        trl.GRPOTrainer(model=copy.deepcopy(model), processing_class=tok, reward_funcs=[reward],
                        args=args("b", min_p=0.1), train_dataset=ds, rollout_func=dasrl_rollout()).train()


# ------------------------------------------------------------------------- issue 37 item 16
def test_a_resumed_run_keys_its_seeds_on_the_trainers_step(tmp_path, tiny_chat):
    """A run of 2 steps checkpointed, then resumed for a 3rd: the session generating the 3rd step is at
    step 2 (its seeds are the uninterrupted run's), not at step 0 (b46648a: step 0's seeds again). On the
    tiny Llama over SmolLM2's tokenizer: what is checked is the step, and a SmolLM2 checkpoint (weights and
    optimizer state, ~1.6 GB) made this test 20-60 s of the suite."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    import copy

    from dasrl.integrations.trl import dasrl_rollout

    model, tok, _ = tiny_chat
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    ds = datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": q}] for q in
                                                ("What is 3+4?", "Name a color.", "Say hi.", "Count to 5.")]})
    seen: list[tuple[int, int]] = []  # (trainer's global_step, session step) at each reward call

    def run(max_steps: int, resume: bool):
        roll = dasrl_rollout(speculate=True, policy="das")

        def reward(completions, completion_ids, **kw):
            seen.append((trainer.state.global_step, roll.session.step))
            return [float(len(c) % 7) / 7 for c in completion_ids]
        args = trl.GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                              max_completion_length=8, max_steps=max_steps, learning_rate=1e-5, bf16=False,
                              gradient_checkpointing=False, use_cpu=True, report_to="none", seed=0,
                              logging_steps=1, save_strategy="steps", save_steps=2, temperature=0.8,
                              dataloader_num_workers=0)
        trainer = trl.GRPOTrainer(model=copy.deepcopy(model), processing_class=tok, reward_funcs=[reward],
                                  args=args, train_dataset=ds, rollout_func=roll)
        trainer.train(resume_from_checkpoint=resume or None)
    run(2, resume=False)
    assert seen == [(0, 0), (1, 1)]
    seen.clear()
    run(3, resume=True)
    assert seen == [(2, 2)]


@pytest.mark.parametrize("prompt, msg", [
    ([{"role": "user"}], r"prompt 0, message 0: expected \{'role': str, 'content': str or list\}"),
    ([{"content": "hi"}], r"prompt 0, message 0: expected"),
    (["hi"], r"prompt 0, message 0: expected"),
    ([], r"prompt 0: expected a text or a non-empty list of chat messages"),
    (None, r"prompt 0: expected a text or a non-empty list of chat messages"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "tool", "content": 3}],
     r"prompt 0, message 2: expected"),
])
def test_bad_chat_messages_are_named(smollm, prompt, msg):
    """Bad messages reached the chat template and failed inside jinja (KeyError / UndefinedError)."""
    pytest.importorskip("trl")
    from dasrl.integrations.trl import DASRollout

    _, tok = smollm
    with pytest.raises(ValueError, match=msg):
        DASRollout()._prompt_ids(0, prompt, tok)
    assert DASRollout()._prompt_ids(0, [{"role": "user", "content": "hi"}], tok)  # a good one still works
