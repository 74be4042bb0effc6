"""Drafters the lab compares against or checks with: the pure-Python reference (the native index's oracle),
arctic-inference's suffix cache (vLLM's `suffix`), and the n-gram / static baselines."""
