"""Drafters the lab compares against: arctic-inference's suffix cache (vLLM's `suffix`). The n-gram and oracle
baselines are the library's (`dasrl.drafter.NGramDrafter`, `OracleDrafter`); the pure-Python reference index,
the native index's oracle, is the tests' (tests/support/reference.py)."""
