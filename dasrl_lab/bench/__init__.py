"""Benchmarks and probes with their CLIs (`dasrl bench ...`, `dasrl calibrate`): tooling, not the library,
which imports nothing of them (tests/test_layering.py). The helpers import lazily: vLLM workers load this."""

from __future__ import annotations


def write_json_out(json_out, doc, console) -> None:
    """--json: write the results (when given) and say where."""
    from dasrl.atomic import write_json

    if json_out is not None:
        write_json(json_out, doc)
        console.print(f"wrote {json_out}")
