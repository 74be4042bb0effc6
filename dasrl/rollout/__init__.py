"""The RL-facing side: rollout sessions, traces, load balancing."""
