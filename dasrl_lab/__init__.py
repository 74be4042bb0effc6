"""dasrl's lab: the `dasrl` command and the tools around the library (demo, what-if, simulator, benches, the
paper's experiments, tasks, CHAMP, comparison drafters, the closed-form policies). It reaches the library
only through dasrl's public names (tests/test_layering.py); nothing in the library imports it.
"""
