"""dasrl: distribution-aware speculative decoding for the rollout phase of RL post-training."""

__version__ = "0.1.0"
