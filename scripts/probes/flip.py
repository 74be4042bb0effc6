"""Take one fidelity flip apart: regenerate the variant's batch (here batch=8, requests 88-95, T=1, top-p 0.95),
recompute the prefix's batch-1 logits at the flipped position and re-run both levels of the race
(docs/benchmarks.md, "Fidelity": request 93, position 59)."""
import numpy as np, torch
torch.set_num_threads(1)
from dasrl.models import load_model
from dasrl.engine.engine import EngineConfig, SpecEngine
from dasrl.engine.sampling import SamplingParams, kept, token_noise, _key, _RACE, _gumbel, _BLOCK_STREAM, BLOCK
from dasrl_lab.bench.engine import PROBLEMS, chat_prompts
m, tok = load_model()
eng = SpecEngine(m, tok, EngineConfig(num_threads=1))
base = chat_prompts(tok, [PROBLEMS[i % 24] for i in range(24)])
prompts = [p for p in base for _ in range(4)]
idx = list(range(88, 96)); sp = SamplingParams(temperature=1.0, top_p=0.95)
out = eng.generate([prompts[i] for i in idx], seeds=[2000 + i for i in idx], sampling=sp, max_new_tokens=60, ignore_eos=True)
c = out[idx.index(93)].token_ids
print("batch-8 token at 59:", c[59])
seq = prompts[93] + c[:59]
with torch.inference_mode():
    l = m(input_ids=torch.tensor([seq])).logits[0, -1:].float()
k = kept(l, sp)
s = ((l.double() - k.lmax.double()) / 1.0)[0]
keep = (l >= k.floor)[0]
print("kept", int(keep.sum()), "floor", float(k.floor), "l[11495]", float(l[0,11495]), "l[2028]", float(l[0,2028]), "kept?", bool(keep[11495]), bool(keep[2028]))
# the top-p boundary: mass of tokens strictly above floor vs top_p
p = (torch.exp(s) / torch.exp(s).sum()).numpy(); order = np.argsort(-l[0].numpy(), kind="stable"); cs = np.cumsum(p[order])
j = int(np.argmax(cs >= 0.95)); print("cut rank", j, "cum before/at cut %.9f %.9f" % (cs[j-1], cs[j]))
key = _key(np.array([2093]), np.array([59]), _RACE)
for t in (11495, 2028):
    b = t // BLOCK
    print(t, "block", b, "block mass", float(k.block_mass[0, b]))
mass = k.block_mass.numpy(); gb = _gumbel(key, np.arange(mass.shape[1]), _BLOCK_STREAM)[0]
with np.errstate(divide="ignore"): sc = np.log(mass[0]) + gb
o = np.argsort(-sc); print("block race top2", o[:2], "margin %.3e" % (sc[o[0]] - sc[o[1]]))
for b in o[:2]:
    ids = np.arange(b*BLOCK, (b+1)*BLOCK); g = token_noise(np.array([2093]), np.array([59]), ids[None])[0]
    ss = np.where(keep.numpy()[ids], s.numpy()[ids], -np.inf) + g; oo = np.argsort(-ss)
    print(" block", b, "token race top2", ids[oo[:2]], "margin %.3e" % (ss[oo[0]] - ss[oo[1]]))
