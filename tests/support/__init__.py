"""What the library's tests check against and nothing ships: the pure-Python reference index (the native index's
oracle) and the lab blocker. Importable as `support` (tests/ is on sys.path: pyproject's pytest `pythonpath`).
Nothing here imports dasrl_lab, and nothing in dasrl_lab imports this."""
