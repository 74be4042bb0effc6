"""Benchmarks and probes with their CLIs (`dasrl bench ...`, `dasrl calibrate`): tooling, not the library.

They use the library's own code (drafter, policy, engine, rollout, sim, integrations); nothing in the
library imports them (tests/test_layering.py).
"""
