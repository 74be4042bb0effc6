"""Speculation policy: how many draft tokens each live request gets this step."""

from dasrl.policy.base import BudgetPolicy, FixedBudget, NoSpeculation, RequestState
from dasrl.policy.budget import (POLICIES, AcceptancePrior, AcceptanceStats, ClassCaps, ConfidencePolicy,
                                 DASPolicy, OptimalPolicy, UnboundedBudget, make_policy, optimal_budgets,
                                 solve_n_fwd)
from dasrl.policy.latency import LatencyModel
from dasrl.policy.length import LengthClassifier, LengthConfig

__all__ = ["BudgetPolicy", "FixedBudget", "NoSpeculation", "RequestState", "LatencyModel", "POLICIES",
           "AcceptancePrior", "AcceptanceStats", "ClassCaps", "ConfidencePolicy", "DASPolicy", "OptimalPolicy",
           "UnboundedBudget", "make_policy", "optimal_budgets", "solve_n_fwd", "LengthClassifier", "LengthConfig"]
