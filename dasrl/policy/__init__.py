"""Speculation policy: how many draft tokens each live request gets this step."""

from dasrl.policy.base import BudgetPolicy, FixedBudget, NoSpeculation, RequestState

__all__ = ["BudgetPolicy", "FixedBudget", "NoSpeculation", "RequestState"]
