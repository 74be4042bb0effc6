"""Offline: does choosing a draft's branch by the sampler's own noise raise acceptance at T > 0?

Replays a recorded trace (the baseline rollouts of a collection run or a demo) step by step, every row
drafting up to K tokens at every forward (no policy), with the history of the previous steps in a
DraftStore, and counts forwards (per row, and the slowest row = the step's makespan in forwards) and
accepted tokens for:
  chain    the store's chain drafts (the best child at every node)
  coupled  the store's tree drafts (branching B, 3K nodes) turned into the one chain the position-keyed
           race would sample if the model's distribution were the history's (dasrl.engine.coupling)
The replay is exact: the recorded tokens were sampled with seeds sample_seed(run seed, step, problem,
sample), and acceptance only compares drafts against them.

    python scripts/probes/coupling.py runs/experiments/collect-*/trace [K] [B] [run_seed]
"""
import sys

import numpy as np

from dasrl.drafter.base import DraftParams
from dasrl.drafter.store import DraftStore, StoreConfig
from dasrl.engine.coupling import couple
from dasrl.engine.sampling import SamplingParams
from dasrl.rollout.session import sample_seed
from dasrl.rollout.trace import read_trace

path = sys.argv[1]
K = int(sys.argv[2]) if len(sys.argv) > 2 else 16
B = int(sys.argv[3]) if len(sys.argv) > 3 else 8
RUN_SEED = int(sys.argv[4]) if len(sys.argv) > 4 else 0
SAMPLING = SamplingParams(temperature=0.6, top_p=0.95)
steps = list(read_trace(path).by_step())


def replay(variant: str) -> list[dict]:
    params = DraftParams(branching=1) if variant == "chain" else DraftParams(branching=B)
    store = DraftStore(StoreConfig(mode="problem+request", params=params))
    out = []
    for step, resp in steps:
        if step > 0:
            keys = list(range(len(resp)))
            seeds = np.array([sample_seed(RUN_SEED, step, r.problem_id, r.sample) for r in resp], np.int64)
            for k, r in zip(keys, resp):
                store.start(k, r.problem_id, r.prompt_ids.tolist())
                store.observe(k, r.response_ids[:1].tolist())
            pos = np.ones(len(resp), np.int64)
            fw = np.ones(len(resp), np.int64)
            acc = drafted = first_n = first_hit = 0
            live = [k for k in keys if pos[k] < len(resp[k].response_ids)]
            while live:
                caps = [min(K, len(resp[k].response_ids) - int(pos[k]) - 1) for k in live]
                if variant == "chain":
                    d = store.propose_flat(live, caps)
                else:
                    d = couple(store.propose_flat(live, [3 * c for c in caps]), sampling=SAMPLING,
                               seeds=seeds[live], positions=pos[live]).capped(np.array(caps))
                for i, k in enumerate(live):
                    toks = d.tokens[d.offsets[i]:d.offsets[i + 1]]
                    if len(toks):
                        first_n += 1
                        first_hit += int(toks[0] == resp[k].response_ids[int(pos[k])])
                    t, p = resp[k].response_ids, int(pos[k])
                    a = 0
                    while a < len(toks) and toks[a] == t[p + a]:
                        a += 1
                    n = min(a + 1, len(t) - p)
                    store.observe(k, t[p:p + n].tolist())
                    pos[k] += n
                    fw[k] += 1
                    acc += a
                    drafted += len(toks)
                for k in [k for k in live if pos[k] >= len(resp[k].response_ids)]:
                    store.finish(k)
                live = [k for k in live if pos[k] < len(resp[k].response_ids)]
            out.append({"step": step, "row_forwards": int(fw.sum()), "makespan": int(fw.max()),
                        "longest": int(max(len(r.response_ids) for r in resp)), "accepted": acc, "drafted": drafted,
                        "first": first_hit / max(first_n, 1)})
        for r in resp:  # the step's rollouts become history, as RolloutSession.end_step does
            store.add_rollout(r.problem_id, r.prompt_ids.tolist(), r.response_ids.tolist())
        store.end_step()
    return out


res = {v: replay(v) for v in ("chain", "coupled")}
print(f"K={K} B={B}: step | longest | makespan chain/coupled | row-forwards chain/coupled | acceptance chain/coupled")
for a, b in zip(res["chain"], res["coupled"]):
    print(f"{a['step']:3d} | {a['longest']:4d} | {a['makespan']:4d} / {b['makespan']:4d} | "
          f"{a['row_forwards']:6d} / {b['row_forwards']:6d} | {a['accepted'] / max(a['drafted'], 1):.3f} / "
          f"{b['accepted'] / max(b['drafted'], 1):.3f} | first-token hit {a['first']:.3f} / {b['first']:.3f}")
tot = {v: [sum(s[f] for s in r) for f in ("makespan", "row_forwards", "accepted", "drafted")] for v, r in res.items()}
print("total makespan chain/coupled:", tot["chain"][0], tot["coupled"][0], " row-forwards:", tot["chain"][1],
      tot["coupled"][1], " accepted:", tot["chain"][2], tot["coupled"][2], " drafted:", tot["chain"][3], tot["coupled"][3])
