"""The drafter benchmark's workload and decode loop measure what they claim (no timing assertions)."""

from __future__ import annotations

import json

import numpy as np
from typer.testing import CliRunner

from dasrl_lab.cli import app
from dasrl_lab.bench import drafter as B
from dasrl_lab.drafters.baselines import NGramDrafter, OracleDrafter
from dasrl.drafter.store import DraftStore, StoreConfig


def test_mutation_rates():
    rng = np.random.default_rng(0)
    base = rng.integers(0, B.VOCAB, 4000)
    for kind in ("point", "span"):
        changed = (B.mutate(base, kind=kind, rate=0.1, rng=rng) != base).mean()
        assert 0.05 < changed <= 0.11, kind


def test_oracle_accepts_its_whole_budget():
    problems = B.make_workload(10_000, kind="point", rate=0.1, seed=1)
    oracle = OracleDrafter({f"fresh-{i}": p.fresh for i, p in enumerate(problems)})
    stats = B.decode(oracle, problems, budget=7, tokens=400)
    assert stats["accepted_per_step"] == 7.0  # 400 = 50 steps of 7 accepted + 1 emitted


def test_history_drafter_beats_prompt_lookup_on_repeated_rollouts():
    problems = B.make_workload(40_000, kind="span", rate=0.1, seed=2)
    store = DraftStore(StoreConfig(mode="problem+request"))
    for i, p in enumerate(problems):
        for h in p.history:
            store.add_rollout(i, p.prompt, h)
    store.end_step()
    ours = B.decode(store, problems, budget=16, tokens=300)["accepted_per_step"]
    ngram = B.decode(NGramDrafter(), problems, budget=16, tokens=300)["accepted_per_step"]
    assert ours > 3.0 > ngram


def test_every_command_has_help():
    import typer

    def paths(cmd, prefix: list[str]):
        yield prefix
        if hasattr(cmd, "commands"):
            for name, sub in cmd.commands.items():
                yield from paths(sub, prefix + [name])

    runner = CliRunner()
    all_paths = list(paths(typer.main.get_command(app), []))
    assert ["bench", "drafter"] in all_paths
    for p in all_paths:
        r = runner.invoke(app, p + ["--help"])
        assert r.exit_code == 0 and "Usage" in r.output, (p, r.output)


def test_bench_drafter_cli_writes_json(tmp_path, monkeypatch):
    monkeypatch.setattr(B.DrafterBenchConfig, "__init__", _tiny_init(B.DrafterBenchConfig.__init__))
    out = tmp_path / "d.json"
    r = CliRunner().invoke(app, ["bench", "drafter", "--json", str(out)])
    assert r.exit_code == 0, r.output
    rows = json.loads(out.read_text())
    keys = {"drafter", "mutation", "corpus_tokens", "speculate_us_p50", "batched_speculate_us_per_request",
            "append_us_per_token", "build_us_per_token", "bytes_per_token", "accepted_per_step"}
    measured = [r for r in rows if "absent" not in r]
    assert measured and all(keys | {"observe_single_us_per_token", "append_cpu_us_per_token"} <= set(r)
                            for r in measured)
    assert all("batched_speculate_us_per_request_core" in r for r in measured if r["drafter"] == "dasrl")
    assert {r["drafter"] for r in rows} >= {"dasrl", "arctic"}  # arctic measured, or reported absent
    assert all(r["drafter"] == "arctic" and r["absent"] for r in rows if "absent" in r)


def test_bench_drafter_refuses_bad_flags():
    for flag in ("0", str(10**12), "-1"):
        r = CliRunner().invoke(app, ["bench", "drafter", "--budget", flag])
        assert r.exit_code == 2 and flag in r.output, r.output


def _tiny_init(init):
    def tiny(self, **kw):
        init(self, **(kw | {"corpus_sizes": (10_000,), "decode_tokens": 100, "batch": 8}))
    return tiny
