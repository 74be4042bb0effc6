"""The DAS drafter's floor on a recorded run (docs/benchmarks.md "The floor of the DAS drafter").

Per step, every live row drafts K tokens at every forward (no allowance, no policy), replayed in lockstep
from the step's recorded outputs, the drafter's history built from the earlier steps as the DAS session
builds it. The step then takes the fewest forwards this drafter allows (K = 0: plain decoding). Each
lockstep forward is priced by a latency model as if only the accepted draft tokens had been drafted (a
policy that never wastes a token): a lower bound of the step's forward time with this drafter.

    python scripts/probes/floor.py TRACE_DIR LATENCY_JSON [K ...] [--counting]

--counting: the drafter a session builds (the DraftStore with counting drafts, the embedded model's
tokenizer) instead of the DraftStore alone.
"""
import sys
from dasrl.drafter.counting import CountingDrafter
from dasrl.drafter.store import DraftStore, StoreConfig
from dasrl.policy.latency import LatencyModel
from dasrl.rollout.trace import read_trace

args = [a for a in sys.argv[1:] if a != "--counting"]
path, lat = args[0], LatencyModel.load(args[1])
Ks = [int(k) for k in args[2:]] or [16]
digits = None
if "--counting" in sys.argv:
    from transformers import AutoTokenizer

    from dasrl.drafter.counting import digit_tokens
    from dasrl.models import ensure_hf_folder
    digits = digit_tokens(AutoTokenizer.from_pretrained(ensure_hf_folder()))
rows = read_trace(path).responses()
steps = sorted({r.step for r in rows})
by_step = {s: [r for r in rows if r.step == s] for s in steps}


def replay(history_steps, resp_rows, K):
    """(forwards, seconds, paid): the step's lockstep forwards, their zero-waste price and their price with
    every drafted token paid (every row drafting K at every forward)."""
    store = DraftStore(StoreConfig(mode="problem+request"))
    for s in history_steps:
        for r in by_step[s]:
            store.add_rollout(r.problem_id, r.prompt_ids, r.response_ids)
        store.end_step()
    st = store if digits is None else CountingDrafter(store, digits)
    resp = [r.response_ids.tolist() for r in resp_rows]
    plen = [len(r.prompt_ids) for r in resp_rows]
    for k, r in enumerate(resp_rows):
        st.start(k, r.problem_id, r.prompt_ids)
    pos = [0] * len(resp)
    live = [k for k in range(len(resp)) if resp[k]]
    forwards, seconds, paid = 0, 0.0, 0.0
    while live:
        ds = st.propose(live, [max(0, min(K, len(resp[k]) - pos[k] - 1)) for k in live]) if K else [None] * len(live)
        tokens = kv = draft_kv = drafted = 0
        for k, d in zip(live, ds):
            toks, t, p, a = ([] if d is None else list(d.tokens)), resp[k], pos[k], 0
            while a < len(toks) and toks[a] == t[p + a]:
                a += 1
            n = min(a + 1, len(t) - p)
            st.observe(k, t[p:p + n])
            tokens, kv, drafted = tokens + 1 + a, kv + plen[k] + p, drafted + len(toks) - a
            draft_kv += (plen[k] + p) if a else 0
            pos[k] += n
        forwards += 1
        seconds += float(lat.predict(tokens, kv, draft_kv))
        paid += float(lat.predict(tokens + drafted, kv, draft_kv))
        for k in [k for k in live if pos[k] >= len(resp[k])]:
            st.finish(k)
        live = [k for k in live if pos[k] < len(resp[k])]
    return forwards, seconds, paid


print("step | plain forwards | plain s (model) | " + " | ".join(f"floor@{K} forwards | s | ratio | all draft {K}: s | ratio" for K in Ks))
tot = [0.0] * (len(Ks) + 1)
totp = [0.0] * len(Ks)
for i, s in enumerate(steps):
    f0, s0, _ = replay(steps[:i], by_step[s], 0)
    cells = []
    for j, K in enumerate(Ks):
        f, sec, paid = replay(steps[:i], by_step[s], K)
        cells.append(f"{f} | {sec:.1f} | {sec / s0:.2f} | {paid:.1f} | {paid / s0:.2f}")
        if i:
            tot[j + 1] += sec
            totp[j] += paid
    if i:
        tot[0] += s0
    print(f"{s} | {f0} | {s0:.1f} | " + " | ".join(cells))
print("steps 1+ | | " + f"{tot[0]:.1f} | " + " | ".join(f" | {t:.1f} | {t / tot[0]:.2f} | {q:.1f} | {q / tot[0]:.2f}"
                                                    for t, q in zip(tot[1:], totp)))
