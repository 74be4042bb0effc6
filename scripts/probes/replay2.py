import os
import sys, json, numpy as np
from dasrl.drafter.store import DraftStore, StoreConfig
K = int(sys.argv[1]); runs = json.load(open(os.environ.get('PROBE_DIR', '/tmp/p') + '/runs.json'))
st = DraftStore(StoreConfig(mode="problem+request"))
for pid, p, r in zip(runs['pids'], runs['prompts'], runs['e1']): st.add_rollout(pid, p, r)
st.end_step()
resp = runs['ref']; keys = list(range(len(resp)))
for k in keys: st.start(k, runs['pids'][k], runs['prompts'][k])
pos = {k: 1 for k in keys}; fw = {k: 1 for k in keys}; acc = {k: 0 for k in keys}; dr = {k: 0 for k in keys}
for k in keys: st.observe(k, resp[k][:1])
live = [k for k in keys if pos[k] < len(resp[k])]
while live:
    ds = st.propose(live, [min(K, len(resp[k]) - pos[k] - 1) for k in live])
    for k, d in zip(live, ds):
        toks = list(d.tokens) if d.is_chain else []
        t = resp[k]; p = pos[k]; a = 0
        while a < len(toks) and toks[a] == t[p + a]: a += 1
        n = min(a + 1, len(t) - p); st.observe(k, t[p:p + n]); pos[k] += n; fw[k] += 1; acc[k] += a; dr[k] += len(toks)
    for k in [k for k in live if pos[k] >= len(resp[k])]: st.finish(k)
    live = [k for k in live if pos[k] < len(resp[k])]
for k in sorted(keys, key=lambda k: -fw[k])[:6]: print(k, runs['pids'][k], len(resp[k]), 'fw', fw[k], 'dr', dr[k], 'acc', acc[k])
