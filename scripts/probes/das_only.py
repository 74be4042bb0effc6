import os
import sys, json, numpy as np, torch, time
from dasrl.models import load_model
from dasrl.engine.engine import SpecEngine, EngineConfig, Completion
from dasrl.engine.sampling import SamplingParams
from dasrl_lab.bench.engine import das_policy
from dasrl.drafter.store import DraftStore, StoreConfig
th = int(sys.argv[1]); M = 512
runs = json.load(open(os.environ.get('PROBE_DIR', '/tmp/p') + '/runs.json'))
model, tok = load_model("smollm2-135m")
eng = SpecEngine(model, tok, EngineConfig(num_threads=th))
prompts, pids = runs['prompts'], runs['pids']
e1 = [Completion(i, p, t, [], None) for i, (p, t) in enumerate(zip(prompts, runs['e1']))]
sp = SamplingParams(temperature=0.6, top_p=0.95)
s2 = [2000 + i for i in range(len(prompts))]
for rep in range(int(sys.argv[2]) if len(sys.argv) > 2 else 1):
    d = DraftStore(StoreConfig(mode="problem+request"))
    for pid, c in zip(pids, e1): d.add_rollout(pid, c.prompt_ids, c.token_ids)
    d.end_step()
    infos = []
    out = eng.generate(prompts, seeds=s2, sampling=sp, drafter=d, policy=das_policy(pids, e1), max_new_tokens=M,
                       problem_ids=pids, on_step=infos.append)
    a = np.array([[i.batch_size, i.tokens, i.drafted, i.accepted, i.forward_s, i.verify_s] for i in infos[1:]])
    print(f"das wall {infos[-1].elapsed_s:.1f} steps {len(a)} fwd {a[:,4].sum():.1f} ver {a[:,5].sum():.1f} drafted {a[:,2].sum():.0f} acc {a[:,3].sum():.0f} exact {[c.token_ids for c in out] == runs['ref']}")
