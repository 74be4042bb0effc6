"""`dasrl whatif`: hand-worked replays, its replay against the simulator and against the engine's
recorded counts (benchmarks/demo_math_t06_trace), the sources' parsing and errors, the profiles, and the CLI end to
end on a CHAMP slice."""

from __future__ import annotations

import json
import os
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from dasrl.policy.base import FixedBudget
from dasrl_lab.trace import Response, write_trace
from dasrl_lab.sim import profiles, sources, whatif
from dasrl_lab.sim.simulator import SimConfig, Simulator, group_steps, replay_step
from dasrl_lab.sim.vllm_baselines import VLLMNGramDrafter

ROOT = Path(__file__).resolve().parents[2]


def earliest_longest_match(ctx: np.ndarray, min_n: int, max_n: int) -> int | None:
    """Start of the continuation vLLM's ngram proposer drafts: after the earliest occurrence (ending
    before the last token) of the longest suffix n-gram of `ctx` with min_n <= n <= max_n; None if none."""
    total = ctx.size
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(ctx[:-1], n)
        hits = np.flatnonzero((windows == ctx[-n:]).all(axis=1))
        if hits.size:
            return int(hits[0]) + n
    return None


@pytest.fixture(scope="module")
def tok():
    pytest.importorskip("transformers")
    return sources.hf_tokenizer(None)


def _resp(step, pid, prompt, response, sample=0):
    return Response(step=step, problem_id=pid, sample=sample, prompt_ids=np.asarray(prompt, np.int32),
                    response_ids=np.asarray(response, np.int32))


# ---------------------------------------------------------------------------------------- hand-worked


def test_ngram_replay_by_hand():
    """Prompt 10..14 20 21, response 10..14 20 21 22. Forward 1 (prefill) emits 10; forwards 2-5 emit 11-14
    (no earlier 5-gram); after 14 the 5-gram 10..14 occurs first at 0, so the draft is what followed it,
    20 21 10 ..., capped by the row's room (8 - 5 generated - 1 pending = 2): 20 and 21, both accepted,
    and 22 the target's own. 6 forwards for 8 tokens."""
    r = _resp(0, "p", [10, 11, 12, 13, 14, 20, 21], [10, 11, 12, 13, 14, 20, 21, 22])
    st = replay_step(VLLMNGramDrafter(), FixedBudget(16), 0, [r], max_new_tokens=8)
    assert (st.forwards, st.tokens, st.proposed, st.accepted) == (6, 8, 2, 2)
    assert [s[1] for s in st.shapes] == [7, 1, 1, 1, 1, 1 + 2]
    assert st.host_s > 0  # the seconds spent proposing and observing between the forwards are measured


def test_none_is_one_token_per_forward_and_prices_by_hand():
    r = [_resp(0, "a", [1, 2], [5, 6, 7]), _resp(0, "b", [3], [8])]
    st = replay_step(None, FixedBudget(0), 0, r, max_new_tokens=3)
    # prefill: the 3 prompt tokens of both rows; b is done; a then reads its cached prompt + output less
    # the pending token: 2 + 1 - 1 = 2, then 3
    assert st.shapes == [(2, 3, 0, 0), (1, 1, 2, 0), (1, 1, 3, 0)]
    rep = whatif.Replay("none", "none", [st], [3])
    prof = profiles.measured("x", profiles.LatencyModel(1.0, 0.1, 0.01), "test")
    assert rep.price(prof) == pytest.approx([(1 + 0.3) + (1 + 0.1 + 0.02) + (1 + 0.1 + 0.03)])
    fig = rep.figures()
    assert fig["tokens_per_forward"] == pytest.approx(4 / 4) and fig["critical_tokens_per_forward"] == 1.0


def test_history_replay_by_hand():
    """Step 0 has no history and no repetition: 6 forwards. Step 1 repeats it: the prefill emits 1, then
    the per-problem index drafts what followed '1', capped by the room (6 - 1 generated - 1 pending = 4):
    2 3 4 5, all accepted, and 6 the target's own: 2 forwards. 12 tokens / 8 forwards."""
    steps = group_steps([_resp(0, "p", [7, 8], [1, 2, 3, 4, 5, 6]), _resp(1, "p", [7, 8], [1, 2, 3, 4, 5, 6])])
    rep = whatif.replay(steps, method="das-suffix", policy=FixedBudget(16), cfg=whatif.WhatifConfig(),
                        tokenizer=None, label="x")
    assert [s.forwards for s in rep.steps] == [6, 2]
    assert rep.figures()["tokens_per_forward"] == pytest.approx(12 / 8)
    assert rep.figures(1)["critical_tokens_per_forward"] == pytest.approx(3.0)
    assert (rep.steps[1].proposed, rep.steps[1].accepted) == (4, 4)


def test_the_vllm_proposers_replay_by_hand():
    """das-vllm is the DASProposer's drafter: each draft cut to max_spec_factor (1.0) x its match length. The
    steps of test_history_replay_by_hand: after the prefill emits 1 the match is 7 8 1 (3 tokens), so it drafts
    2 3 4 (not the room's 4), all accepted, 5 the target's own, then 6: 3 forwards where das-suffix takes 2."""
    steps = group_steps([_resp(0, "p", [7, 8], [1, 2, 3, 4, 5, 6]), _resp(1, "p", [7, 8], [1, 2, 3, 4, 5, 6])])
    rep = whatif.replay(steps, method="das-vllm", policy=FixedBudget(16), cfg=whatif.WhatifConfig(),
                        tokenizer=None, label="x")
    assert [(s.forwards, s.proposed, s.accepted) for s in rep.steps] == [(6, 0, 0), (3, 3, 3)]


def test_the_vllm_proposer_runs_in_the_replay_by_hand():
    """das-vllm replays the proposer itself (BatchDrafter, fed token rows as vLLM's runner feeds it). Step 1 asks
    another prompt of problem p (9 9 8, as CHAMP's variants do): after the prefill emits 1, the match in step 0's
    rollout is 8 1 (2 tokens), so it drafts 2 3 (max_spec_factor 1.0), both accepted, 4 the target's own; then
    the match 8 1 2 3 4 drafts 5 within the room (6 tokens at most, 4 out, one pending), 6 its own: 3 forwards.
    The replay's host seconds are the proposer's calls alone, and an own-defaults replay is priced by the
    profile (a proposer with a latency model and a fixed policy, or neither, is refused)."""
    from dasrl.integrations.vllm import VLLMDrafterConfig
    from dasrl_lab.sim.proposer_replay import ProposerReplay

    steps = group_steps([_resp(0, "p", [7, 8], [1, 2, 3, 4, 5, 6]), _resp(1, "p", [9, 9, 8], [1, 2, 3, 4, 5, 6])])
    cfg = whatif.WhatifConfig()
    drafter = whatif.make_drafter("das-vllm", cfg, None, lengths=(3, 6))
    stats = [replay_step(drafter, FixedBudget(16), s, rs, max_new_tokens=6) for s, rs in steps]
    assert [(s.forwards, s.proposed, s.accepted) for s in stats] == [(6, 0, 0), (3, 3, 3)]
    assert drafter.take_host_s() == drafter.tracker.stats.propose_s > 0 and drafter.take_host_s() == 0.0
    assert drafter.tracker.stats.calls == 6 + 3  # after every forward
    lat = profiles.shipped()[0].latency
    rep = whatif.replay(steps, method="das-vllm", policy=FixedBudget(16), cfg=cfg, tokenizer=None, label="x",
                        latency=lat)
    assert all(s.host_s > 0 for s in rep.steps)
    with pytest.raises(ValueError, match="'fixed' needs no latency"):
        ProposerReplay(replace(VLLMDrafterConfig(), policy="fixed"), k=4, max_prompt=3, max_new=6, latency=lat,
                       digits=None)
    with pytest.raises(ValueError, match="'das' needs a latency"):
        ProposerReplay(VLLMDrafterConfig(), k=4, max_prompt=3, max_new=6, latency=None,
                       digits=None)


def test_oracle_by_hand():
    """History of problem p: '1 2 3 4' twice and '1 2 9 9' once (as three samples of step 0). At step 1
    the response is 1 2 9 9 5: after the prefill emits 1, das-suffix drafts the frequent 2 3 4 (2
    accepted, 9 the target's own), then 9 (room 1, accepted) and 5: 3 forwards; the oracle drafts 2 9 9
    (the rarer occurrence that agrees), all accepted, and 5 its own: 2 forwards."""
    hist = [_resp(0, "p", [7], r, sample=k) for k, r in enumerate([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 9, 9]])]
    steps = group_steps(hist + [_resp(1, "p", [7], [1, 2, 9, 9, 5])])
    cfg = whatif.WhatifConfig()
    das = whatif.replay(steps, method="das-suffix", policy=FixedBudget(3), cfg=cfg, tokenizer=None, label="d")
    orc = whatif.replay(steps, method="oracle", policy=FixedBudget(3), cfg=cfg, tokenizer=None, label="o")
    assert (das.steps[1].proposed, das.steps[1].accepted, das.steps[1].forwards) == (3 + 1, 1 + 1, 3)
    assert (orc.steps[1].proposed, orc.steps[1].accepted, orc.steps[1].forwards) == (3, 3, 2)


@pytest.mark.parametrize("seed", range(3))
def test_oracle_bounds_the_history_drafter(seed):
    """On random repetitive rollouts (siblings in flight, several problems), the oracle's drafts are all
    accepted and every step takes no more forwards than das-suffix's (a chain from a source's longest
    match agrees with the truth at most as far as the best occurrence of that match)."""
    rng = np.random.default_rng(seed)
    base = [rng.integers(0, 6, 40).tolist() for _ in range(3)]
    rs = [_resp(s, p, [90 + p], [t if rng.random() > 0.15 else int(rng.integers(0, 6)) for t in base[p]], sample=g)
          for s in range(4) for p in range(3) for g in range(2)]
    steps = group_steps(rs)
    cfg = whatif.WhatifConfig()
    orc = whatif.replay(steps, method="oracle", policy=FixedBudget(8), cfg=cfg, tokenizer=None, label="o")
    das = whatif.replay(steps, method="das-suffix", policy=FixedBudget(8), cfg=cfg, tokenizer=None, label="d")
    assert all(s.accepted == s.proposed for s in orc.steps)
    assert orc.figures()["tokens_per_forward"] >= das.figures()["tokens_per_forward"]
    with pytest.raises(KeyError, match="was not told the response"):
        whatif.make_drafter("oracle", cfg, None).start("x", "p", [1])


@pytest.mark.parametrize("seed", range(5))
def test_ngram_index_agrees_with_the_scan(seed):
    rng = np.random.default_rng(seed)
    for min_n, max_n in ((5, 5), (2, 4), (1, 3)):
        d = VLLMNGramDrafter(min_n, max_n)
        seq = rng.integers(0, 3, 60).tolist()
        d.start("r", None, seq[:5])
        for i in range(5, 60):
            ctx = np.asarray(seq[:i])
            start = earliest_longest_match(ctx, min_n, max_n) if i >= min_n else None
            want = [] if start is None else ctx[start:start + 8].tolist()
            assert d.propose(["r"], [8])[0].tokens.tolist() == want
            d.observe("r", [seq[i]])


# ----------------------------------------------------------------- whatif's replay == the simulator's


@pytest.mark.parametrize("method,branching", [(m, 1) for m in whatif.METHODS if m != "oracle"]  # (the oracle: below)
                         + [("das", 3), ("das-suffix", 3)])  # trees: the one accept rule walks them in both
def test_whatif_replay_equals_the_simulator(method, branching, tok):
    if method == "suffix":
        pytest.importorskip("arctic_inference.suffix_decoding")
    rng = np.random.default_rng(1)
    base = [rng.integers(0, 50, int(rng.integers(5, 60))).tolist() for _ in range(4)]
    rs = [_resp(s, p, [100 + p, 7, 8], (base[p][:3] + rng.integers(0, 50, 3).tolist() + base[p][3:])[: 20 + 9 * g],
                sample=g) for s in range(3) for p in range(4) for g in range(2)]
    steps = group_steps(rs)
    store = whatif.WhatifConfig().store
    cfg = whatif.WhatifConfig(store=replace(store, params=replace(store.params, branching=branching)))
    lat = profiles.shipped()[0].latency
    mx = max(len(r.response_ids) for r in rs)  # whatif's length limit: the longest recorded response
    lengths = (max(len(r.prompt_ids) for r in rs), mx)  # das-vllm's token rows
    # das-vllm sets its own budgets (the proposer's policy): the replay's policy only caps them
    policies = (lambda: FixedBudget(6),) + (() if method == "das-vllm" else (lambda: whatif.session_policy(lat),))
    for make_policy in policies:
        fast = whatif.replay(steps, method=method, policy=make_policy(), cfg=cfg, tokenizer=tok, label="f").steps
        sim = Simulator(drafter=whatif.make_drafter(method, cfg, tok, lengths=lengths) or "none", policy=make_policy(),
                        config=SimConfig(max_new_tokens=mx))
        ref = [sim.run_step(s, r, max_new_tokens=mx) for s, r in steps]
        for a, b in zip(fast, ref):
            assert (a.forwards, a.row_forwards, a.tokens, a.proposed, a.accepted) == \
                (b.forwards, b.row_forwards, b.tokens, b.proposed, b.accepted)
            assert [tuple(x) for x in a.shapes] == [tuple(x) for x in b.shapes]


def test_replay_matches_the_engine_on_the_demo_trace(tok):
    """benchmarks/demo_math_t06_trace is the `dasrl demo --temperature 0.6 --steps 3` run of
    benchmarks/demo_math_t06.json (math preset, the session's priced policy): the session's drafter and
    policy replayed over it give the engine's forwards, drafted and accepted tokens exactly, step by step."""
    from dasrl.rollout.session import SessionConfig, history_drafter, speculation_policy
    from dasrl_lab.trace import read_trace

    doc = json.loads((ROOT / "benchmarks/demo_math_t06.json").read_text())
    steps = dict(read_trace(ROOT / "benchmarks/demo_math_t06_trace").by_step())
    # recorded before the store's cross-problem source (issue 35) and before the CPU prior was refitted on
    # the tuned engine (issue 34): replayed with the drafter it ran and the CPU_LATENCY it priced with
    from dasrl.policy.latency import LatencyModel

    config = SessionConfig(counting=doc["config"]["counting"], store=replace(SessionConfig().store, cross_problem=False))
    drafter, policy = history_drafter(config, tok), speculation_policy(config)
    policy.latency = LatencyModel(c_base=0.0732, c_tok=3.88e-3, c_other=1.04e-5, c_draft_kv=1.28e-5, c_draft=0.0263)
    for rec in doc["steps"]:
        st = replay_step(drafter, policy, rec["step"], steps[rec["step"]],
                         max_new_tokens=doc["config"]["max_new_tokens"])
        assert (st.forwards, st.proposed, st.accepted) == (rec["das_forwards"], rec["drafted"], rec["accepted"])


# ------------------------------------------------------------------------------------------- sources


def _tokenize(texts):
    return [[ord(c) for c in t] for t in texts]


def test_jsonl_source_text_and_ids(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text("\n".join(json.dumps(d) for d in [
        {"step": 0, "prompt": "ab", "response": "abc"},
        {"step": 0, "prompt": "ab", "response": [1, 2]},
        {"step": 1, "problem_id": 7, "response": "x"},
    ]) + "\n")
    rs = sources.load(p, _tokenize)
    assert [r.response_ids.tolist() for r in rs] == [[97, 98, 99], [1, 2], [120]]
    assert rs[0].problem_id == rs[1].problem_id == "ab" and [r.sample for r in rs] == [0, 1, 0]
    assert rs[0].prompt_ids.tolist() == [97, 98] and rs[2].problem_id == 7


@pytest.mark.parametrize("line, where", [
    ('{"step": 0, "prompt": "a"}', "r.jsonl:2: field 'response': missing"),
    ('{"step": -1, "prompt": "a", "response": "b"}', "r.jsonl:2: field 'step'"),
    ('{"step": 0, "response": "b"}', "r.jsonl:2: field 'problem_id'"),
    ('{"step": 0, "prompt": "a", "response": [1, -3]}', "r.jsonl:2: field 'response'"),
    ('{"step": 0, "prompt": "a", "response": "b"', "r.jsonl:2: not valid JSON"),
    ('[1, 2]', "r.jsonl:2: expected a JSON object"),
])
def test_jsonl_errors_name_file_line_and_field(tmp_path, line, where):
    p = tmp_path / "r.jsonl"
    p.write_text('{"step": 0, "prompt": "a", "response": "b"}\n' + line + "\n")
    with pytest.raises(sources.SourceError, match=where.replace("[", r"\[")):
        sources.load(p, _tokenize)


def test_verl_rollout_data_dir(tmp_path):
    """VeRL 0.9.1's _write_generations: {global_step}.jsonl, fields input, output, gts, score, step."""
    for step in (1, 2):
        rows = [{"input": "q1", "output": f"a{step}", "gts": "1", "score": 0.0, "step": step},
                {"input": "q1", "output": "b", "gts": "1", "score": 1.0, "step": step}]
        (tmp_path / f"{step}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rs = sources.load(tmp_path, _tokenize)
    assert [(r.step, r.problem_id, r.sample) for r in rs] == [(1, "q1", 0), (1, "q1", 1), (2, "q1", 0), (2, "q1", 1)]
    (tmp_path / "notes.jsonl").write_text("{}\n")
    with pytest.raises(sources.SourceError, match="notes.jsonl"):
        sources.load(tmp_path, _tokenize)


def test_parquet_sources(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"step": [0, 0], "problem_id": ["a", "b"], "response": [[1, 2], [3]]}), tmp_path / "g.parquet")
    assert [r.response_ids.tolist() for r in sources.load(tmp_path / "g.parquet", _tokenize)] == [[1, 2], [3]]
    pq.write_table(pa.table({"step": [0], "problem_id": ["a"], "response": [[1, -2]]}), tmp_path / "bad.parquet")
    with pytest.raises(sources.SourceError, match=r"bad.parquet:0: field 'response'"):
        sources.load(tmp_path / "bad.parquet", _tokenize)
    trace = [_resp(0, 3, [1], [4, 5])]
    write_trace(tmp_path / "t.parquet", trace)
    got = sources.load(tmp_path / "t.parquet", _tokenize)
    assert got[0].response_ids.tolist() == [4, 5] and got[0].problem_id == 3


def test_champ_source_and_its_errors():
    pytest.importorskip("champ_dataset")
    from dasrl_lab import champ

    probs = champ.load_problems()
    assert len(probs) == 270 and probs[0].answer == "239"
    sols = champ.load_solutions("GPT-4")
    assert len(sols) == 270 and all(len(v) == 18 for v in sols.values())
    s = sols["P_Combinatorics_1"]["0-Shot"]
    assert "length 6" in s.prompt and not s.text.startswith("The number of strings")  # not the summary turn
    rs = sources.load("champ", _tokenize, champ=sources.ChampSource(problems=2, variants=("0-Shot", "5-Shot"),
                                                                    samples=2))
    assert [(r.step, r.problem_id, r.sample) for r in rs] == [
        (0, "P_Combinatorics_1", 0), (0, "P_Combinatorics_2", 0), (0, "P_Combinatorics_1", 1), (0, "P_Combinatorics_2", 1)]
    # "No C w/o H" is the 0-Shot solution verbatim for every problem: a copy is left out unless asked for
    assert sols["P_Combinatorics_1"]["No C w/o H"].text == sols["P_Combinatorics_1"]["0-Shot"].text
    pair = dict(problems=2, variants=("0-Shot", "No C w/o H", "5-Shot"))
    assert [(r.step, r.problem_id) for r in sources.load("champ", _tokenize, champ=sources.ChampSource(**pair))] == [
        (0, "P_Combinatorics_1"), (0, "P_Combinatorics_2"), (2, "P_Combinatorics_1"), (2, "P_Combinatorics_2")]
    assert len(sources.load("champ", _tokenize, champ=sources.ChampSource(**pair, copies=True))) == 6
    # G = 4 siblings per step over 18 variants: steps of 4, 4, 4, 4 and the 2 left (copies kept here)
    g4 = sources.load("champ", _tokenize, champ=sources.ChampSource(problems=1, samples=4, copies=True))
    assert [sum(r.step == k for r in g4) for k in range(5)] == [4, 4, 4, 4, 2]
    for bad, msg in ((sources.ChampSource(model="GPT-5"), "unknown CHAMP model"),
                     (sources.ChampSource(variants=("7-Shot",)), "unknown variant"),
                     (sources.ChampSource(samples=19), r"must be in \[1, 18\]"),
                     (sources.ChampSource(samples=0), "got 0")):
        with pytest.raises(sources.SourceError, match=msg):
            sources.load("champ", _tokenize, champ=bad)


# ------------------------------------------------------------------------------------------ profiles


def test_profiles_from_first_principles():
    total, streamed = profiles.param_counts(profiles.MODELS["qwen2.5-7b"])
    assert total == pytest.approx(7.62e9, rel=0.01)  # Qwen2.5-7B's model card: 7.61B
    assert profiles.param_counts(profiles.MODELS["qwen2.5-32b"])[0] == pytest.approx(32.8e9, rel=0.01)
    p = profiles.derive("qwen2.5-7b", "h100")
    assert p.status == "assumed" and p.name == "qwen2.5-7b-h100"
    # 14.1 GB streamed at 0.8 x 3.35 TB/s + 1 ms; 2 x 7.07e9 FLOPs at 0.6 x 989 TFLOPS
    assert p.latency.c_base == pytest.approx(streamed * 2 / (0.8 * 3.35e12) + 1e-3)
    assert p.latency.c_tok == pytest.approx(2 * streamed / (0.6 * 989e12))
    assert p.latency.c_other == pytest.approx(2 * 28 * 4 * 128 * 2 / (0.8 * 3.35e12))
    with pytest.raises(ValueError, match="does not fit"):
        profiles.derive("qwen2.5-32b", "l4")


# ----------------------------------------------------------------------------------------------- CLI


def test_cli_end_to_end_on_a_champ_slice(tmp_path):
    pytest.importorskip("champ_dataset")
    from typer.testing import CliRunner

    from dasrl_lab.cli import app

    methods = "das,das-vllm,das-suffix,global,ngram,none"
    lat = tmp_path / "cpu.json"
    lat.write_text(json.dumps({"format": "dasrl.latency/1", "c_base": 0.05, "c_tok": 0.002}))
    out, png = tmp_path / "w.json", tmp_path / "w.png"
    res = CliRunner().invoke(app, ["whatif", "champ", "--problems", "3", "--variants", "0-Shot,5-Shot,1/3 Soln",
                                   "--methods", methods, "--latency", f"cpu={lat}", "--json", str(out),
                                   "--png", str(png)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert png.stat().st_size > 0
    rows = {r["drafter"]: r for r in doc["rows"]}
    assert set(rows) == set(methods.split(","))
    names = [p["name"] for p in doc["profiles"]]
    assert names == [*profiles.SHIPPED, "cpu"] and doc["profiles"][0]["status"] == "assumed"
    assert rows["none"]["tokens_per_forward"] == 1.0 and rows["none"]["acceptance"] == 0.0
    assert all(r["tokens_per_forward"] >= 1.0 and len(r["steps"]) == 3 for r in rows.values())
    assert all(len(line) <= 80 for line in res.output.splitlines())
    # bad input: one error naming the file, line and field; nothing written
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 0, "prompt": "a", "response": "b"}\n{"step": "x", "response": "b"}\n')
    out2 = tmp_path / "w2.json"
    res = CliRunner().invoke(app, ["whatif", str(bad), "--methods", "none", "--json", str(out2)])
    assert res.exit_code == 2 and "bad.jsonl:2: field 'step'" in res.output and not out2.exists()


# ------------------------------------------------------------------------- issue 37: junk sources
def _in_thread(fn, timeout: float = 30):
    """fn() in a daemon thread: what it returned or raised; a call that hangs (a FIFO with no writer) fails
    the test instead of the run."""
    import threading

    out: list = []

    def go():
        try:
            out.append(("ok", fn()))
        except BaseException as e:  # noqa: BLE001 (handed to the test)
            out.append(("raised", e))
    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(timeout)
    assert out, f"{fn} hangs"
    return out[0]


def test_cli_whatif_on_a_prompt_less_jsonl_prints_its_table(tmp_path):
    """docs/whatif.md: prompt optional beside a problem_id. Each of these crashed with "empty prompt for
    request (0, 0)" on b46648a: no prompt, an empty id list, empty text, and a VeRL line with an empty input."""
    from typer.testing import CliRunner

    from dasrl_lab.cli import app

    lines = {"none.jsonl": ['{"step": 0, "problem_id": "a", "response": "The answer is 4."}',
                            '{"step": 0, "problem_id": "a", "response": "The answer is 5."}',
                            '{"step": 1, "problem_id": "a", "response": "The answer is 4."}'],
             "ids.jsonl": ['{"step": 0, "problem_id": "a", "prompt": [], "response": "The answer is 4."}',
                           '{"step": 1, "problem_id": "a", "prompt": [], "response": "The answer is 4."}'],
             "text.jsonl": ['{"step": 0, "problem_id": "a", "prompt": "", "response": "The answer is 4."}',
                            '{"step": 1, "problem_id": "a", "prompt": "", "response": "The answer is 4."}']}
    for name, rows in lines.items():
        (tmp_path / name).write_text("\n".join(rows) + "\n")
    verl = tmp_path / "verl"
    verl.mkdir()
    for step in (1, 2):
        (verl / f"{step}.jsonl").write_text(json.dumps({"input": "", "output": "The answer is 4.", "step": step}) + "\n")
    for src in [*(tmp_path / n for n in lines), verl]:
        out = tmp_path / f"{src.stem}.json"
        res = CliRunner().invoke(app, ["whatif", str(src), "--methods", "das,none", "--json", str(out)])
        assert res.exit_code == 0, (src, res.output, res.exception)
        assert "tok/fwd" in res.output
        doc = json.loads(out.read_text())
        assert {r["drafter"] for r in doc["rows"]} == {"das", "none"}
    rs = sources.load(tmp_path / "none.jsonl", _tokenize)
    assert [r.prompt_ids.tolist() for r in rs] == [list(sources.STAND_IN_PROMPT)] * 3


def test_fifos_devices_and_folders_are_refused_not_read(tmp_path):
    """A FIFO hung every loader but the store's on b46648a; /dev/zero read until memory ran out; a folder
    named like a step file gave IsADirectoryError."""
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    kind, e = _in_thread(lambda: sources.load(fifo, _tokenize))
    assert kind == "raised" and isinstance(e, sources.SourceError) and "not a regular file" in str(e), e
    zero = tmp_path / "zero.jsonl"
    os.symlink("/dev/zero", zero)
    kind, e = _in_thread(lambda: sources.load(zero, _tokenize))
    assert kind == "raised" and isinstance(e, sources.SourceError) and "not a regular file" in str(e), e
    verl = tmp_path / "verl"
    verl.mkdir()
    (verl / "1.jsonl").write_text(json.dumps({"input": "q", "output": "a", "step": 1}) + "\n")
    os.mkfifo(verl / "2.jsonl")
    kind, e = _in_thread(lambda: sources.load(verl, _tokenize))
    assert kind == "raised" and isinstance(e, sources.SourceError) and "2.jsonl: not a regular file" in str(e), e
    os.unlink(verl / "2.jsonl")
    (verl / "3.jsonl").mkdir()
    with pytest.raises(sources.SourceError, match="3.jsonl: not a regular file"):
        sources.load(verl, _tokenize)
    parquet = tmp_path / "fifo.parquet"
    os.mkfifo(parquet)
    kind, e = _in_thread(lambda: sources.load(parquet, _tokenize))
    assert kind == "raised" and isinstance(e, sources.SourceError) and "not a regular file" in str(e), e


@pytest.mark.parametrize("line, where", [
    ("[" * 100_000 + "]" * 100_000, "r.jsonl:2: not valid JSON (RecursionError"),
    ('{"step": 0, "prompt": "a", "response": "x\\ud800y"}', "r.jsonl:2: field 'response': text is not valid Unicode"),
    ('{"step": 0, "prompt": "\\udfff", "response": "b"}', "r.jsonl:2: field 'prompt': text is not valid Unicode"),
])
def test_junk_lines_are_file_line_errors(tmp_path, tok, line, where):
    """Deep nesting (RecursionError) and a lone surrogate (TypeError in the tokenizer) were tracebacks."""
    p = tmp_path / "r.jsonl"
    p.write_text('{"step": 0, "prompt": "a", "response": "b"}\n' + line + "\n")
    with pytest.raises(sources.SourceError, match=re.escape(where)):
        sources.load(p, sources.tokenize_with(tok))


def test_verl_file_names_must_be_ascii_digits(tmp_path):
    (tmp_path / "1.jsonl").write_text(json.dumps({"input": "q", "output": "a", "step": 1}) + "\n")
    (tmp_path / "².jsonl").write_text(json.dumps({"input": "q", "output": "a", "step": 2}) + "\n")
    with pytest.raises(sources.SourceError, match="found ².jsonl"):  # int('²') raised ValueError
        sources.load(tmp_path, _tokenize)


def test_token_ids_outside_the_tokenizer_are_refused(tmp_path, tok):
    p = tmp_path / "r.jsonl"
    p.write_text('{"step": 0, "problem_id": 1, "response": [1, 2]}\n'
                 f'{{"step": 0, "problem_id": 1, "response": [3, {len(tok)}]}}\n')
    with pytest.raises(sources.SourceError, match=rf"r.jsonl:2: field 'response': token id {len(tok)} is outside "
                                                   rf"the tokenizer's vocabulary \(size {len(tok)}\)"):
        sources.load(p, sources.tokenize_with(tok), vocab_size=len(tok))
    write_trace(tmp_path / "t.parquet", [_resp(0, 3, [1], [4, len(tok) + 5])])
    with pytest.raises(sources.SourceError, match="outside the vocabulary"):
        sources.load(tmp_path / "t.parquet", _tokenize, vocab_size=len(tok))


@pytest.mark.parametrize("what, msg", [("missing", "no such folder"), ("file", "not a folder"),
                                       ("empty", "holds no tokenizer files"), ("bad", "cannot load it")])
def test_cli_whatif_tokenizer_that_is_not_one(tmp_path, what, msg):
    from typer.testing import CliRunner

    from dasrl_lab.cli import app

    src = tmp_path / "r.jsonl"
    src.write_text('{"step": 0, "problem_id": "a", "response": "b"}\n')
    folder = tmp_path / "tok"
    if what == "file":
        folder.write_text("x")
    elif what in ("empty", "bad"):
        folder.mkdir()
        if what == "bad":
            (folder / "tokenizer.json").write_text('{"model": 3}')
    res = CliRunner().invoke(app, ["whatif", str(src), "--tokenizer", str(folder), "--methods", "none"])
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and f"tokenizer {folder}: {msg}" in text, (text, res.exception)
    assert "Traceback" not in text


def test_parallel_replays_give_the_serial_figures(tok):
    """run_all with forked workers: the same replays, figure for figure, as one after the other."""
    rng = np.random.default_rng(2)
    base = [rng.integers(0, 30, 40).tolist() for _ in range(3)]
    rs = [_resp(s, p, [90 + p], base[p][: 25 + 5 * s]) for s in range(3) for p in range(3)]
    cfg = whatif.WhatifConfig(methods=("das", "das-suffix", "oracle", "none"))
    profs = profiles.shipped()[:1]
    named = [("a", rs), ("a", rs[:6])]  # a repeated name stays two sources
    serial = whatif.run_all(named, profiles=profs, cfg=cfg, tokenizer=tok, jobs=1)
    forked = whatif.run_all(named, profiles=profs, cfg=cfg, tokenizer=tok, jobs=2)
    def figures(results):  # every row but the seconds this process took (replays, host work)
        def strip(row):
            out = {k: v for k, v in row.items() if k not in ("replay_s", "replay_cpu_s", "host_s_per_step")}
            out["steps"] = [{k: v for k, v in st.items() if k != "host_s"} for st in row["steps"]]
            return out
        return [[strip(row) for row in r.rows(profs, cfg)] for r in results]
    assert figures(serial) == figures(forked)
    for row in serial[0].rows(profs, cfg):  # each profile's own-defaults replay, by its counts
        own = serial[0].own[(row["drafter"], profs[0].name)].figures()
        assert row["own_figures"][profs[0].name]["wasted_per_token"] == round(
            (own["drafted"] - own["accepted"]) / own["tokens"], 4)
    with pytest.raises(ValueError, match="jobs must be >= 1, got 0"):
        whatif.run_all(named, profiles=profs, cfg=cfg, tokenizer=tok, jobs=0)
    bare = whatif.run_all(named[:1], profiles=[], cfg=cfg, tokenizer=tok)[0]  # no profile: equal cap only
    got = [{k: v for k, v in row.items() if k not in ("replay_s", "replay_cpu_s")} for row in bare.rows([], cfg)]
    assert got == [{k: (v if k not in ("predicted_s_per_step", "predicted_s_per_step_at_cap", "own_figures",
                                       "host_s_per_step") else {})
                                   for k, v in row.items() if k not in ("replay_s", "replay_cpu_s")}
                                  | {"steps": [{k: (v if k not in ("predicted_s", "host_s") else {}) for k, v in st.items()}
                                               for st in row["steps"]]}
                                  for row in serial[0].rows(profs, cfg)]


def test_a_dead_worker_raises_instead_of_hanging():
    """`dasrl whatif --jobs 2` waited forever when a worker died (SIGKILL, the OOM killer): the pool lost its
    task. Now the run fails with BrokenProcessPool. Run in a process of its own, under a timeout, so a
    hang fails this test instead of the suite."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import os, signal, sys
        import numpy as np
        from concurrent.futures.process import BrokenProcessPool
        from dasrl_lab.trace import Response
        from dasrl_lab.sim import profiles, sources, whatif

        def die(*a, **k):
            os.kill(os.getpid(), signal.SIGKILL)
        whatif.replay = die  # the forked workers inherit it
        rs = [Response(step=s, problem_id=0, sample=0, prompt_ids=np.asarray([5], np.int32),
                       response_ids=np.arange(20, dtype=np.int32)) for s in range(2)]
        cfg = whatif.WhatifConfig(methods=("none", "oracle"))
        try:
            whatif.run_all([("a", rs)], profiles=profiles.shipped()[:1], cfg=cfg,
                           tokenizer=sources.hf_tokenizer(None), jobs=2)
        except BrokenProcessPool:
            sys.exit(3)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert done.returncode == 3, done.stderr.decode(errors="replace")[-2000:]


def test_the_gpu_prior_is_the_derived_7b_h100_profile():
    """The library's GPU prior is rounded from the lab's assumed 7B/H100 profile."""
    from dasrl.policy.latency import GPU_LATENCY

    derived = profiles.derive("qwen2.5-7b", "h100").latency
    for name in ("c_base", "c_tok", "c_other"):
        assert getattr(GPU_LATENCY, name) == pytest.approx(getattr(derived, name), rel=0.01), name
