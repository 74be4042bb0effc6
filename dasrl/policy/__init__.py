"""Speculation policy: how many draft tokens each live request gets this step, priced by a latency model."""

from dasrl.policy.acceptance import AcceptanceRate
from dasrl.policy.allowance import ForwardAllowance, tokens_per_forward
from dasrl.policy.base import BudgetPolicy, FixedBudget, NoSpeculation, PolicyBase, RequestState, SessionPolicy
from dasrl.policy.budget import ClassCaps, DASPolicy, HistoryPolicy
from dasrl.policy.factory import POLICIES, make_policy
from dasrl.policy.latency import (CPU_LATENCY, GPU_LATENCY, LatencyModel, OnlineLatency, nonnegative_lstsq,
                                  prior_for)
from dasrl.policy.length import CLASSES, LengthClassifier, LengthConfig
from dasrl.policy.propose import propose

__all__ = ["AcceptanceRate", "ForwardAllowance", "tokens_per_forward", "BudgetPolicy", "FixedBudget",
           "NoSpeculation", "PolicyBase", "RequestState", "SessionPolicy", "ClassCaps", "DASPolicy", "HistoryPolicy",
           "POLICIES", "make_policy", "CPU_LATENCY", "GPU_LATENCY", "LatencyModel", "OnlineLatency",
           "nonnegative_lstsq", "prior_for", "CLASSES", "LengthClassifier", "LengthConfig", "propose"]
