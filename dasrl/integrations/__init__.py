"""Integrations with RL frameworks; each imports its framework lazily (optional extras)."""
