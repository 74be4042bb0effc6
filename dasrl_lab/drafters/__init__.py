"""Drafters the lab compares against: arctic-inference's suffix cache (vLLM's `suffix`, arctic.py), n-gram prompt
lookup and the oracle (baselines.py). The pure-Python reference index, the native index's oracle, and the
drafters the library's tests draft with are the tests' (tests/support/)."""
