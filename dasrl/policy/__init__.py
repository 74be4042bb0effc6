"""Speculation policy: how many draft tokens each live request gets this step, priced by a latency model."""

from dasrl.policy.allowance import ClassCaps, ForwardAllowance
from dasrl.policy.base import BudgetPolicy, FixedBudget, PolicyBase, RequestState
from dasrl.policy.factory import POLICIES, make_policy
from dasrl.policy.latency import (CPU_LATENCY, GPU_LATENCY, LatencyModel, OnlineLatency, nonnegative_lstsq,
                                  prior_for)
from dasrl.policy.length import LengthClassifier, LengthConfig
from dasrl.policy.propose import propose

__all__ = ["ClassCaps", "ForwardAllowance", "BudgetPolicy", "FixedBudget", "PolicyBase", "RequestState", "POLICIES",
           "make_policy", "CPU_LATENCY", "GPU_LATENCY", "LatencyModel", "OnlineLatency", "nonnegative_lstsq",
           "prior_for", "LengthClassifier", "LengthConfig", "propose"]
