"""TRL: a `rollout_func` for `trl.GRPOTrainer` (TRL >= 1.16) backed by a RolloutSession.

    from dasrl.integrations.trl import dasrl_rollout
    trainer = GRPOTrainer(model=model, processing_class=tok, reward_funcs=[...], args=args,
                          train_dataset=ds, rollout_func=dasrl_rollout())

TRL passes the prompts of this process (each already repeated num_generations times, chat prompts as
message lists) and no dataset columns, so the problem key is the prompt-token hash. A new
`trainer.state.global_step` means the previous step's rollouts are final: the session's window rolls.
Sampling follows the trainer's arguments (temperature, top_p, top_k, max_completion_length).
"""

from __future__ import annotations

from dataclasses import replace

from dasrl.engine.sampling import SamplingParams
from dasrl.rollout.session import RolloutSession, SessionConfig


def _require_trl() -> None:
    try:
        import trl  # noqa: F401
    except ImportError as e:
        raise ImportError("the TRL integration needs trl: pip install 'dasrl[trl]' (trl>=1.16)") from e


class DASRollout:
    """Callable `rollout_func(prompts, trainer) -> {"prompt_ids", "completion_ids", "logprobs"}`."""

    def __init__(self, config: SessionConfig = SessionConfig()) -> None:
        _require_trl()
        self.config = config
        self.session: RolloutSession | None = None
        self._step: int | None = None

    def _prompt_ids(self, prompt, tokenizer) -> list[int]:
        if isinstance(prompt, list):  # conversational: a list of messages
            ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])

    def __call__(self, prompts: list, trainer) -> dict:
        tok = trainer.processing_class
        model = trainer.accelerator.unwrap_model(trainer.model)
        if self.session is None:
            self.session = RolloutSession(model, tok, replace(self.config, seed=int(trainer.args.seed)))
        step = int(trainer.state.global_step)
        if self._step is not None and step != self._step:
            self.session.end_step()
        self._step = step
        args = trainer.args
        sampling = SamplingParams(temperature=float(args.temperature), top_p=float(args.top_p or 1.0),
                                  top_k=int(args.top_k or 0))
        ids = [self._prompt_ids(p, tok) for p in prompts]
        was_training = model.training
        model.eval()
        try:
            rollouts = self.session.generate(ids, sampling=sampling, max_new_tokens=int(args.max_completion_length))
        finally:
            model.train(was_training)
        return {"prompt_ids": [r.prompt_ids for r in rollouts],
                "completion_ids": [r.completion_ids for r in rollouts],
                "logprobs": [r.logprobs for r in rollouts]}


def dasrl_rollout(**config) -> DASRollout:
    """A rollout_func; keyword arguments are SessionConfig fields (e.g. speculate=False, policy="das")."""
    return DASRollout(SessionConfig(**config))
