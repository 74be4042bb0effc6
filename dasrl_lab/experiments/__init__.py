"""`dasrl experiments`: the DAS paper's measurements, regenerated with dasrl (see docs/results.md)."""
