"""Drafters: proposals of draft tokens from rollout history, behind one protocol."""

from dasrl.drafter.base import Draft, Drafter, DraftParams, problem_key

__all__ = ["Draft", "Drafter", "DraftParams", "problem_key"]
