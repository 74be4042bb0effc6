"""The vLLM bench's config and module layout, and `dasrl bench proposer` (none of them runs vLLM)."""

from __future__ import annotations

import json

import pytest


def test_bench_compares_without_per_request_seeds_by_default():
    from dataclasses import asdict

    from dasrl_lab.bench.vllm_bench import VLLMBenchConfig

    cfg = VLLMBenchConfig(temperature=1.0)
    assert cfg.seeded is False and asdict(cfg)["seeded"] is False  # what vllm_run reads
    assert VLLMBenchConfig(temperature=1.0, seeded=True).seeded


def test_bench_modules_import_one_way():
    """vllm_bench.py (parent) imports vllm_run.py (child entry point); vllm_run.py imports nothing of vllm_bench."""
    import ast
    from pathlib import Path

    import dasrl_lab.bench.vllm_run as child

    tree = ast.parse(Path(child.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "dasrl_lab.bench.vllm_bench" not in imported, imported


def test_the_proposer_bench_times_real_drafting(tmp_path):
    """`dasrl bench proposer`'s workload: siblings re-sampling the last step's answers are drafted and
    accepted under fixed k; bad batch sizes are refused by name."""
    from typer.testing import CliRunner

    from dasrl_lab.bench.proposer import ProposerBenchConfig, run_one
    from dasrl_lab.cli import app

    cfg = ProposerBenchConfig(batches=(8,), length=40)
    fixed = run_one(cfg, 8, {"policy": "fixed", "max_spec_factor": 0.0})
    assert 0 < fixed["accepted"] < fixed["drafted"] and fixed["steps_timed"] > 0 and fixed["host_ms_per_step"] > 0
    with pytest.raises(ValueError, match=r"multiples of 4.*\(6,\)"):
        ProposerBenchConfig(batches=(6,))
    out = tmp_path / "p.json"
    res = CliRunner().invoke(app, ["bench", "proposer", "--batches", "4", "--repeats", "1", "--json", str(out)])
    assert res.exit_code == 0, res.output
    from dasrl_lab.drafters.arctic import arctic_available

    suffix = ["suffix"] if arctic_available() else []  # vLLM's own, where arctic-inference is installed
    rows = json.loads(out.read_text())
    assert [r["policy"] for r in rows] == ["fixed", "das"] + suffix
    assert all(r["drafted"] > 0 for r in rows if r["policy"] == "suffix")


def test_aggregate_keeps_each_steps_drafts():
    """Each step's row carries vLLM's draft count beside its draft tokens, so tokens per draft can be read for the
    first visit too (the row's `drafts` total covers the later steps only)."""
    from dasrl_lab.bench.vllm_bench import aggregate

    def step(drafts: int, tokens: int, accepted: int) -> dict:
        return {"wall_s": 2.0, "gen_tokens": 10, "drafts": drafts, "draft_tokens": tokens, "accepted": accepted,
                "outputs": [[1] * 10], "rewards": [None]}

    run = {"method": "das", "temperature": 1.0, "steps": [step(4, 12, 3), step(5, 20, 9)]}
    row = aggregate([run], None)
    assert [(s["drafts"], s["drafted"], s["accepted"]) for s in row["per_step"][0]] == [(4, 12, 3), (5, 20, 9)]
    assert (row["drafts"], row["draft_tokens"], row["accepted_tokens"]) == (5, 20, 9)  # later steps only


def test_ms_per_output_token_is_compared_step_by_step():
    """Hand-worked: ms per output token per step is the median over repeats of wall / tokens, the first visit
    included, and each method's ratio to none and suffix is taken step by step."""
    from dasrl_lab.bench.vllm_bench import aggregate, compare

    def run(method: str, steps: list[tuple[float, int]]) -> dict:
        return {"method": method, "temperature": 1.0,
                "steps": [{"wall_s": w, "gen_tokens": n, "drafts": 0, "draft_tokens": 0, "accepted": 0,
                           "outputs": [[1] * n], "rewards": [None]} for w, n in steps]}

    # none: 20 ms/token at both steps in every repeat; suffix: 10 then 16; das: repeats 8 / 12 / 30 at step 0
    # (median 12) and 8 / 8 / 8 at step 1
    none = [run("none", [(2.0, 100), (4.0, 200)]) for _ in range(3)]
    suffix = [run("suffix", [(1.0, 100), (1.6, 100)]) for _ in range(3)]
    das = [run("das", [(0.8, 100), (0.8, 100)]), run("das", [(1.2, 100), (1.6, 200)]),
           run("das", [(3.0, 100), (0.4, 50)])]
    rows = [aggregate(none, None), aggregate(suffix, none), aggregate(das, none)]
    compare(rows)
    by = {r["method"]: r for r in rows}
    assert by["none"]["ms_per_token_by_step"] == [20.0, 20.0]
    assert by["das"]["ms_per_token_by_step"] == [12.0, 8.0]
    assert by["das"]["ms_per_token_ratio_vs_none"] == [0.6, 0.4]
    assert by["das"]["ms_per_token_ratio_vs_suffix"] == [1.2, 0.5]
    assert by["suffix"]["ms_per_token_ratio_vs_none"] == [0.5, 0.8] and "ms_per_token_ratio_vs_suffix" not in by["suffix"]
    assert "time_ratio_vs_none" not in by["none"]
