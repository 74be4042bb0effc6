"""dasrl experiments: the pure computations on hand-worked inputs, the static drafter, the replay, the
CLI's name check, and one end-to-end --quick run of a cheap experiment (slow)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from typer.testing import CliRunner

from dasrl.drafter.store import DraftStore, StoreConfig
from dasrl_lab.experiments.batch import collapse_stats
from dasrl_lab.experiments.drafters import fraction_of_oracle
from dasrl_lab.experiments.registry import EXPERIMENTS, select
from dasrl_lab.experiments.replay import StaticDrafter, TimedDrafter, replay, totals
from dasrl_lab.experiments.similarity import by_lag, ngram_overlap, overlap_matrix
from dasrl_lab.trace import Response


def resp(step, pid, sample, tokens, prompt=(1, 2, 3)):
    return Response(step=step, problem_id=pid, sample=sample, prompt_ids=np.asarray(prompt, np.int32),
                    response_ids=np.asarray(tokens, np.int32))


def test_ngram_overlap_by_hand():
    # a's 3-grams: 123, 234, 345; b's: 234, 345, 459 -> 2 of 3 shared
    assert ngram_overlap([1, 2, 3, 4, 5], [2, 3, 4, 5, 9], n=3) == pytest.approx(2 / 3)
    assert ngram_overlap([1, 2, 3, 4, 5], [1, 2, 3, 4, 5], n=3) == 1.0
    assert ngram_overlap([1, 2], [1, 2], n=3) == 0.0  # no 3-gram in a
    assert ngram_overlap([7, 7, 7, 7], [7, 7, 7], n=2) == 1.0  # distinct n-grams: {77}


def test_overlap_matrix_by_hand():
    # problem 0: step 0 samples [1..5] and [1..4, 9]; step 1 sample [1..5] and [6..10]
    rs = [resp(0, 0, 0, [1, 2, 3, 4, 5]), resp(0, 0, 1, [1, 2, 3, 4, 9]),
          resp(1, 0, 0, [1, 2, 3, 4, 5]), resp(1, 0, 1, [6, 7, 8, 9, 10])]
    steps, m = overlap_matrix(rs, n=4)
    assert steps == [0, 1]
    # diagonal, step 0: sample 0's 4-grams {1234, 2345} vs sibling {1234, 2349}: 1/2; sample 1 symmetric: 1/2
    assert m[0, 0] == pytest.approx(0.5)
    # step 1 siblings share nothing
    assert m[1, 1] == pytest.approx(0.0)
    # step 0 vs step 1 (pool = both step-1 samples): sample 0 -> 2/2, sample 1 -> 1/2
    assert m[0, 1] == pytest.approx(0.75)
    # step 1 vs step 0: sample 0 -> 2/2, sample 1 -> 0/2
    assert m[1, 0] == pytest.approx(0.5)
    assert by_lag(m) == pytest.approx([0.25, 0.625])


def test_fraction_of_oracle_arithmetic():
    f = fraction_of_oracle(10.0, 5.0, 4.0)  # speedups 2.0 and 2.5
    assert f["speedup"] == pytest.approx(2.0)
    assert f["ratio"] == pytest.approx(0.8)
    assert f["gain"] == pytest.approx(1 / 1.5)
    assert fraction_of_oracle(10.0, 10.0, 10.0)["gain"] is None


def test_collapse_stats_by_hand():
    # forwards end at 1, 2, 3, 5 s with 4, 4, 1, 1 rows: row-seconds 4+4+1+2 = 11 over 5 s
    s = collapse_stats([[1, 4], [2, 4], [3, 1], [5, 1]])
    assert s == {"makespan_s": 5.0, "mean_batch": 2.2, "tail_fraction": 0.6}


def _feed(drafter, step, seqs, pid=0):
    for i, toks in enumerate(seqs):
        rid = (step, i)
        drafter.start(rid, pid, [1, 2, 3])
        drafter.observe(rid, toks)
        drafter.finish(rid)
    drafter.end_step()


def test_static_drafter_does_not_change_after_step_0():
    rng = np.random.default_rng(0)
    a, b = rng.integers(10, 500, 40).tolist(), rng.integers(10, 500, 40).tolist()
    static = StaticDrafter(StoreConfig(mode="problem+request"))
    history = DraftStore(StoreConfig(mode="problem+request"))
    for d in (static, history):
        _feed(d, 0, [a])
    frozen = static.num_tokens
    for d in (static, history):
        _feed(d, 1, [b, b])
        _feed(d, 2, [b])
    assert static.num_tokens == frozen and static.step == 1
    assert history.num_tokens > frozen
    for d in (static, history):  # after b's first 8 tokens, only the history has seen what follows
        d.start("q", 0, [1, 2, 3])
        d.observe("q", b[:8])
    assert len(history.propose(["q"], [8])[0]) == 8
    assert len(static.propose(["q"], [8])[0]) == 0
    assert static.propose(["q"], [8])[0].tokens.tolist() == []


def test_discard_step_keeps_history_and_drops_the_step():
    s = DraftStore(StoreConfig(mode="problem"))
    _feed(s, 0, [[5, 6, 7, 8]])
    before = (s.num_tokens, s.step)
    s.start("x", 0, [1, 2, 3])
    s.observe("x", [9, 9, 9])
    s.finish("x")
    s.start("y", 0, [1, 2, 3])  # unfinished
    s.discard_step()
    assert (s.num_tokens, s.step) == before


def test_timed_drafter_counts_rows_per_step():
    t = TimedDrafter(DraftStore())
    t.start("r", 0, [1, 2, 3])
    t.propose(["r"], [4])
    t.propose(["r"], [4])
    t.finish("r")
    t.end_step()
    assert t.per_step[0]["calls"] == 2 and t.per_step[0]["rows"] == 2 and t.per_step[0]["propose_s"] >= 0


def test_replay_history_tracks_a_change_static_does_not():
    rng = np.random.default_rng(1)
    a, b = rng.integers(10, 500, 60).tolist(), rng.integers(10, 500, 60).tolist()
    trace = [resp(0, 0, 0, a), resp(1, 0, 0, b), resp(2, 0, 0, b)]
    hist = replay(trace, DraftStore(StoreConfig(mode="problem")), label="history", budget=8)
    stat = replay(trace, StaticDrafter(StoreConfig(mode="problem")), label="static", budget=8)
    assert [s.step for s in hist] == [0, 1, 2]
    assert hist[0].accepted == 0 and stat[0].accepted == 0  # nothing indexed yet
    # step 2 repeats step 1: the history drafter has it (all but the first token arrives as drafts:
    # each round accepts 8 and adds the target's own token) — the static index does not
    assert hist[2].accepted >= 50 and stat[2].accepted <= 2
    assert hist[2].tokens_per_round > 5 and stat[2].tokens_per_round < 1.1
    assert totals(hist)["accepted_per_round"] > totals(stat)["accepted_per_round"]


def test_select_names_and_errors():
    assert [e.name for e in select([])] == list(EXPERIMENTS)
    assert [e.name for e in select(["window", "batch"])] == ["batch", "window"]
    with pytest.raises(ValueError, match="unknown experiment 'nope'; valid: batch, similarity"):
        select(["batch", "nope"])


def test_cli_rejects_unknown_names():
    from dasrl_lab.cli import app

    r = CliRunner().invoke(app, ["experiments", "fig99"])
    assert r.exit_code != 0
    assert "fig99" in r.output and "drafters" in r.output


@pytest.mark.slow
def test_quick_latency_end_to_end(tmp_path, monkeypatch):
    """`dasrl experiments latency --quick` end to end: the CLI, the calibration on the real model, both fits,
    the JSON, CSV, figure and results page. On a grid of 12 small shapes instead of --quick's 34 (up to 32 rows
    x 12 tokens at context 384) and at one torch thread instead of every core: 5-8 minutes of the suite on two
    loaded cores, a benchmark rather than a test. The calibration is checked shape by shape in
    test_engine_bench.py."""
    from dasrl_lab.bench.engine import CalibrationGrid
    from dasrl_lab.cli import app

    monkeypatch.setattr(CalibrationGrid, "quick", staticmethod(
        lambda: CalibrationGrid(batch_sizes=(1, 4), tokens_per_row=(1, 4), contexts=(16, 64), repeats=1)))
    threads = int(os.environ.get("DASRL_TEST_THREADS", "1"))
    monkeypatch.setattr("dasrl.engine.default_threads", lambda: threads)  # the experiment times on every core
    out, md = tmp_path / "out", tmp_path / "docs" / "results.md"
    r = CliRunner().invoke(app, ["experiments", "latency", "--quick", "--out", str(out), "--results", str(md)])
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "latency" / "latency.json").read_text())
    assert doc["quick"] is True and doc["summary"]["c_base_ms"] > 0
    assert (out / "latency" / "latency.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "latency" / "latency.csv").read_text().startswith("batch,")
    text = md.read_text()
    assert "QUICK RUN" in text and "(Fig. 8)" in text and "results/latency.png" in text
    assert (md.parent / "results" / "latency.png").exists()


def test_source_champ_replays_the_recorded_solutions_and_rejects_bad_input(tmp_path):
    """`dasrl experiments --source champ`: the trace-replay experiments get CHAMP's recorded solutions
    (the 18 variants as steps, tokenized as recorded) instead of the collection run; bad input is one
    usage error before anything is written."""
    pytest.importorskip("champ_dataset")
    from rich.console import Console

    from dasrl_lab import champ
    from dasrl_lab.cli import app
    from dasrl_lab.experiments.base import Context, RunOptions
    from dasrl_lab.sim.sources import ChampSource, hf_tokenizer

    ctx = Context(RunOptions(out=tmp_path, source="champ", champ=ChampSource(model="GPT-4", problems=2)),
                  Console(quiet=True))
    rs, sols, tok = ctx.responses(), champ.load_solutions("GPT-4"), hf_tokenizer(None)
    pids = ("P_Combinatorics_1", "P_Combinatorics_2")  # each variant's solution once: verbatim copies left out
    assert len(rs) == sum(len({sols[p][v].text for v in champ.VARIANTS}) for p in pids) < 2 * 18
    assert ctx._collection is None  # no GRPO collection run behind it
    for r in rs:
        sol = sols[r.problem_id][champ.VARIANTS[r.step]]
        assert r.problem_id in ("P_Combinatorics_1", "P_Combinatorics_2") and r.sample == 0
        assert r.response_ids.tolist() == tok(sol.text, add_special_tokens=False)["input_ids"]
    assert "not a training step" in ctx.replayed()[0]

    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["experiments", "window", "--source", "champ", "--champ-model", "GPT-4",
                                 "--problems", "2", "--out", str(out)])
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "window" / "window.json").read_text())
    assert "CHAMP's recorded GPT-4 solutions" in doc["source"] and doc["details"]["trace_steps"] == len({r.step for r in rs})
    assert "--source champ --champ-model GPT-4 --problems 2" in doc["rerun"]
    assert doc["summary"]["accepted/round w=16"] > 0
    for args, msg in ((["--champ-model", "GPT-5"], "unknown CHAMP model 'GPT-5'"),
                      (["--source", str(tmp_path / "nope.jsonl")], "nope.jsonl: no such file"),
                      (["batch"], "not in batch")):
        bad = tmp_path / "bad"
        r = CliRunner().invoke(app, ["experiments", *args, "--out", str(bad)] + (
            [] if "--source" in args else ["--source", "champ"]), env={"COLUMNS": "400"})
        assert r.exit_code == 2 and msg in " ".join(r.output.translate({ord(c): " " for c in "│╭╮╰╯─"}).split()), r.output
        assert not bad.exists() or not any(bad.iterdir())


def test_results_regeneration_keeps_the_hand_written_sections(tmp_path):
    from dasrl_lab.experiments.report import KEPT, write_results

    md = tmp_path / "results.md"
    md.write_text(f"# old generated part\n\n{KEPT}\n\n## On real text (CHAMP)\n\nby hand\n")
    write_results(tmp_path / "empty", md)
    text = md.read_text()
    assert "old generated part" not in text and text.endswith(f"{KEPT}\n\n## On real text (CHAMP)\n\nby hand\n")
