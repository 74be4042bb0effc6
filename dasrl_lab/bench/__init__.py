"""Benchmarks and probes with their CLIs (`dasrl bench ...`, `dasrl calibrate`): tooling, not the library,
which imports nothing of them (tests/test_layering.py)."""
