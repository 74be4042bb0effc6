"""The experiments, in the order `dasrl experiments` runs them and docs/results.md lists them."""

from __future__ import annotations

from types import MappingProxyType

from dasrl_lab.experiments import (ablation, acceptance, batch, drafters, latency, lengths, scope, similarity,
                                   simulator, window)
from dasrl_lab.experiments.base import Experiment

EXPERIMENTS: "MappingProxyType[str, Experiment]" = MappingProxyType({m.EXPERIMENT.name: m.EXPERIMENT for m in (
    batch, similarity, acceptance, scope, window, latency, lengths, ablation, drafters, simulator)})


def select(names: list[str]) -> list[Experiment]:
    """The named experiments in registry order (all when none is named); unknown names raise, listing the valid ones."""
    bad = [n for n in names if n not in EXPERIMENTS]
    if bad:
        raise ValueError(f"unknown experiment{'s' if len(bad) > 1 else ''} {', '.join(map(repr, bad))}; "
                         f"valid: {', '.join(EXPERIMENTS)}")
    return [e for n, e in EXPERIMENTS.items() if not names or n in names]
