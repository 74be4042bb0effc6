"""Trace-driven simulator and synthetic long-tail workloads."""

from dasrl_lab.sim.simulator import DRAFTERS, SimConfig, SimResult, Simulator, compare, simulate
from dasrl_lab.sim.workloads import WORKLOADS, WorkloadConfig, generate, get_workload

__all__ = ["DRAFTERS", "SimConfig", "SimResult", "Simulator", "compare", "simulate", "WORKLOADS",
           "WorkloadConfig", "generate", "get_workload"]
