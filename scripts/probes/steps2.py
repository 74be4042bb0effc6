import os
import sys, json, time, numpy as np, torch
from dasrl.models import load_model
from dasrl.engine.engine import SpecEngine, EngineConfig
from dasrl.engine.sampling import SamplingParams
from dasrl_lab.bench.engine import das_policy
from dasrl.drafter.store import DraftStore, StoreConfig
from dasrl_lab.drafters.baselines import OracleDrafter
from dasrl_lab.tasks import chat_ids, preset
P, G, M = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]); T = float(sys.argv[4]); th = int(sys.argv[5])
which = sys.argv[6].split(',')
model, tok = load_model("smollm2-135m")
eng = SpecEngine(model, tok, EngineConfig(num_threads=th))
tasks = preset("enumerations").tasks(P, seed=0)
prompts = [chat_ids(tok, t.question) for t in tasks for _ in range(G)]
pids = [i for i in range(P) for _ in range(G)]
sp = SamplingParams(temperature=T, top_p=0.95)
def gen(seeds, drafter=None, policy=None):
    infos = []
    out = eng.generate(prompts, seeds=seeds, sampling=sp, drafter=drafter, policy=policy, max_new_tokens=M,
                       problem_ids=pids, on_step=infos.append)
    return out, infos
e1, _ = gen([1000 + i for i in range(len(prompts))])
s2 = [2000 + i for i in range(len(prompts))]
def hist(d):
    for pid, c in zip(pids, e1): d.add_rollout(pid, c.prompt_ids, c.token_ids)
    d.end_step(); return d
res = {}
ref, inf = gen(s2); res['none'] = inf
json.dump({'e1': [c.token_ids for c in e1], 'ref': [c.token_ids for c in ref], 'prompts': prompts, 'pids': pids}, open(os.environ.get('PROBE_DIR', '/tmp/p') + '/runs.json', 'w'))
log = []
for name in which:
    d = {'das': lambda: hist(DraftStore(StoreConfig(mode="problem+request"))),
         'oracle': lambda: OracleDrafter({i: c.token_ids for i, c in enumerate(ref)})}[name]()
    pol = das_policy(pids, e1)
    orig = pol.budgets
    def budgets(states, orig=orig, pol=pol):
        out = orig(states)
        log.append([(s.req_id, s.generated, s.drafted, s.accepted, b, round(pol._p(s), 3)) for s, b in zip(states, out)])
        return out
    pol.budgets = budgets
    out, inf = gen(s2, d, pol); res[name] = inf
    print(name, 'exact', [c.token_ids for c in out] == [c.token_ids for c in ref])
    json.dump(log, open(os.environ.get('PROBE_DIR', '/tmp/p') + f'/log_{name}.json', 'w')); log.clear()
B = len(prompts)
for name, inf in res.items():
    a = np.array([[i.batch_size, i.tokens, i.drafted, i.accepted, i.forward_s, i.draft_s, i.verify_s, i.new_tokens] for i in inf[1:]])
    wall = inf[-1].elapsed_s
    tail = a[:, 0] <= B / 4
    print(f"{name:7s} wall {wall:6.1f} steps {len(a)} fwd {a[:,4].sum():6.1f} draft {a[:,5].sum():5.1f} ver {a[:,6].sum():5.1f} "
          f"drafted {a[:,2].sum():5.0f} acc {a[:,3].sum():5.0f} | tail steps {tail.sum()} tail fwd {a[tail,4].sum():5.1f} "
          f"tail drafted {a[tail,2].sum():4.0f} acc {a[tail,3].sum():4.0f} | other {wall - a[:,4:7].sum():.1f}")
json.dump({k: [i.__dict__ for i in v] for k, v in res.items()}, open(os.environ.get('PROBE_DIR', '/tmp/p') + '/steps.json', 'w'))
