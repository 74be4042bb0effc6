"""Issue 35 item 2 probe: which history source's draft would be accepted, and how well a choice rule picks it.

CHAMP, one model, G = 1 (a step = a prompt variant), K = 16 chains. Every request advances one token at a
time in lock step with its step's others (in-flight text grows as in a replay); at every position each
source drafts on its own:
  shard  the problem's window + its live requests (the store's problem shard),
  own    the request's own text only,
  cross  every problem's window + every live request (the store's cross-problem index),
and we record per source the match length, the first token's probability, the score (sum of path
probabilities), the accepted length against the recorded text, and the best continuation (oracle).
Then choice rules are compared by mean accepted length per position (1 + that ~ tokens per forward).

    OMP_NUM_THREADS=1 taskset -c 1 .venv/bin/python scripts/probes/sources_probe.py --problems 60 --model GPT-4
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from dasrl.drafter.suffix import SuffixIndex, best_continuation_batch, extend_batch, propose_flat
from dasrl_lab.sim import sources
from dasrl_lab.sim.simulator import group_steps

K, WINDOW, DECAY, MAX_MATCH = 16, 16, 0.8, 64
SOURCES = ("shard", "own", "cross")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="GPT-4")
    ap.add_argument("--problems", type=int, default=60)
    ap.add_argument("--out", default="/tmp/sources_probe.npz")
    a = ap.parse_args()
    tok = sources.hf_tokenizer(None)
    resp = sources.load("champ", sources.tokenize_with(tok), champ=sources.ChampSource(model=a.model, problems=a.problems))
    steps = group_steps(resp)
    shards: dict[object, SuffixIndex] = {}
    cross = SuffixIndex()
    window: list[list[tuple[SuffixIndex, int]]] = []
    next_id = 0
    rec = {k: [] for k in ("step", "t", "row")}
    for s in SOURCES:
        for f in ("m", "p1", "score", "acc", "best"):
            rec[f"{s}_{f}"] = []
    t0 = time.perf_counter()
    for step, rs in steps:
        live, curs = [], {s: [] for s in SOURCES}
        for r in rs:
            sh = shards.setdefault(r.problem_id, SuffixIndex())
            own = SuffixIndex()
            ids = []
            for ix in (sh, own, cross):
                ix.add(next_id, [], 1.0)
                ids.append(next_id)
                next_id += 1
            c_sh = sh.cursor(MAX_MATCH, ids[0])
            c_own = own.cursor(MAX_MATCH, ids[1])
            c_cross = cross.cursor(MAX_MATCH, ids[2])
            for c in (c_sh, c_own, c_cross):
                c.extend(np.asarray(r.prompt_ids, np.int32))
            curs["shard"].append(c_sh), curs["own"].append(c_own), curs["cross"].append(c_cross)
            live.append((sh, ids[0], ids[2]))
        tgt = [np.asarray(r.response_ids, np.int32) for r in rs]
        longest = max(t.size for t in tgt)
        for t in range(longest):
            rows = [i for i in range(len(rs)) if t < tgt[i].size]
            fut = [tgt[i][t:t + K] for i in rows]
            off = np.zeros(len(rows) + 1, np.int64)
            np.cumsum([f.size for f in fut], out=off[1:])
            flat = np.concatenate(fut)
            rec["step"] += [step] * len(rows)
            rec["t"] += [t] * len(rows)
            rec["row"] += rows
            for s in SOURCES:
                cs = [curs[s][i] for i in rows]
                d = propose_flat(cs, np.full(len(rows), K, np.int64))
                for j, i in enumerate(rows):
                    a0, b0 = int(d.offsets[j]), int(d.offsets[j + 1])
                    dt, f = d.tokens[a0:b0], fut[j]
                    n = min(dt.size, f.size)
                    miss = np.flatnonzero(dt[:n] != f[:n])
                    rec[f"{s}_acc"].append(int(miss[0]) if miss.size else n)
                    rec[f"{s}_p1"].append(float(d.probs[a0]) if b0 > a0 else 0.0)
                    rec[f"{s}_score"].append(float(d.probs[a0:b0].sum()))
                rec[f"{s}_m"] += d.match_len.tolist()
                rec[f"{s}_best"] += best_continuation_batch(cs, flat, off).tolist()
            # everyone advances one token: own/shard/cross cursors each take it (each grows its live sequence)
            toks = np.concatenate([tgt[i][t:t + 1] for i in rows]).astype(np.int64)
            o = np.arange(len(rows) + 1, dtype=np.int64)
            for s in SOURCES:
                assert extend_batch([curs[s][i] for i in rows], toks, o) == -1
        # the step ends: its rollouts join the window, the oldest step leaves, weights decay
        window.append([(sh, sid) for sh, sid, _ in live] + [(cross, cid) for _, _, cid in live])
        for ix in list(shards.values()) + [cross]:
            ix.scale_weights(DECAY)
        while len(window) > WINDOW:
            for ix, sid in window.pop(0):
                ix.remove(sid)
        print(f"step {step}: {len(rec['t'])} positions, {time.perf_counter() - t0:.0f} s", flush=True)
    np.savez(a.out, **{k: np.asarray(v) for k, v in rec.items()})
    report(a.out)


def report(path: str) -> None:
    z = np.load(path)
    first = z["step"] == z["step"].min()
    acc = np.stack([z[f"{s}_acc"] for s in SOURCES])  # [S, P]
    score = np.stack([z[f"{s}_score"] for s in SOURCES])
    m = np.stack([z[f"{s}_m"] for s in SOURCES])
    best = np.stack([z[f"{s}_best"] for s in SOURCES])
    cols = np.arange(acc.shape[1])

    def pick(rule):  # [P] accepted under a choice rule: rule -> [P] source index
        return acc[rule, cols]

    # a replay's walk: a row at position t accepts a and moves to t + a + 1 (one forward)
    key = z["step"].astype(np.int64) * 100_000 + z["row"]
    order = np.lexsort((z["t"], key))
    bounds = np.flatnonzero(np.diff(key[order])) + 1
    groups = np.split(order, bounds)  # per request, its positions in order

    def walk(a: np.ndarray, sel=None) -> float:
        tok = fwd = 0
        for g in groups:
            if sel is not None and not sel[g[0]]:
                continue
            t, n = 0, g.size
            while t < n:
                t += int(a[g[t]]) + 1
                fwd += 1
            tok += n
        return tok / fwd

    rules = {
        "shard only": np.zeros(acc.shape[1], int),
        "cross only": np.full(acc.shape[1], 2),
        "max score (shard, cross)": np.where(score[2] > score[0] * (1 + 1e-9), 2, 0),
        "max score (all 3)": np.argmax(score, 0),
        "longest match (all 3)": np.argmax(m, 0),
        "max score * (m >= 4)": np.argmax(score * (m >= 4) + 1e-9 * m, 0),
        "best draft (hindsight)": np.argmax(acc, 0),
    }
    print(f"{acc.shape[1]} positions; per position mean accepted (first step / later):")
    print("  rule                         per position (first / later)   tokens per forward (first / later)")
    for name, r in list(rules.items()) + [("oracle (best continuation)", None)]:
        got = best.max(0) if r is None else pick(r)
        print(f"  {name:28s} {got.mean():.3f} ({got[first].mean():.3f} / {got[~first].mean():.3f})"
              f"   {walk(got):.3f} ({walk(got, first):.3f} / {walk(got, ~first):.3f})")
    for k, s in enumerate(SOURCES):
        print(f"  source {s}: acc {acc[k].mean():.3f}, best {best[k].mean():.3f}, match {m[k].mean():.1f}")


if __name__ == "__main__":
    main()
