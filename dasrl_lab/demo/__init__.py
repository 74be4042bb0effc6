"""`dasrl demo`: GRPO on the embedded model, baseline and DAS rollouts side by side."""
