"""VeRL 0.9 integration: a request router for VeRL's rollout servers (router.py) and the recipe that
turns dasrl's drafter on in VeRL's vLLM rollout (docs/verl.md, examples/). Importing this package does
not import VeRL; `dasrl.integrations.verl.router` does."""

from dasrl.integrations.verl.recipe import Recipe

__all__ = ["Recipe"]
