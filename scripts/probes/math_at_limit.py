"""How many math-preset samples reach the length limit (issue 28: aim <= 10%, must <= 25%).

Plain decoding of the preset's first P problems x G samples (its prompt, stop lines, temperature, top-p),
one thread; prints the at-limit fraction, the median length and how many stated an answer.

    nice -n 5 .venv/bin/python scripts/probes/math_at_limit.py 8 4 512 [temperature]
"""

import sys

import numpy as np

from dasrl.engine.engine import EngineConfig, SpecEngine
from dasrl.engine.sampling import SamplingParams
from dasrl.models import load_model
from dasrl.tasks import chat_ids, preset, stated_answer

P, G, M = (int(a) for a in sys.argv[1:4])
p = preset("math")
T = float(sys.argv[4]) if len(sys.argv) > 4 else p.temperature
model, tok = load_model("smollm2-135m")
engine = SpecEngine(model, tok, EngineConfig(num_threads=1))
tasks = p.tasks(P)
prompts = [chat_ids(tok, t.question, t.system) for t in tasks for _ in range(G)]
outs = engine.generate(prompts, seeds=[7000 + k for k in range(len(prompts))], max_new_tokens=M,
                       sampling=SamplingParams(temperature=T, top_p=p.top_p), stop_lines=p.stop_lines)
lengths = [len(c.token_ids) for c in outs]
stated = [stated_answer(tok.decode(c.token_ids, skip_special_tokens=True)) is not None for c in outs]
print(f"{P} problems x {G} samples, <= {M} tokens, T={T}: at limit "
      f"{np.mean([c.finish_reason == 'length' for c in outs]):.0%}, median {np.median(lengths):.0f} tokens, "
      f"answer stated {np.mean(stated):.0%}, wall {engine.last_run.wall_s:.0f} s")
