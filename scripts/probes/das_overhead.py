"""The DAS path's cost when it drafts nothing: the same math-preset batch generated plainly and through a
speculating session whose drafts cannot pay (docs/policy.md "Never slower"). Interleaved repeats, medians.

    OMP_NUM_THREADS=1 taskset -c 0 python scripts/probes/das_overhead.py [rows] [tokens] [repeats]
"""
import statistics
import sys
import time

import torch

from dasrl.engine.sampling import SamplingParams
from dasrl.models import load_model
from dasrl.rollout.session import RolloutSession, SessionConfig
from dasrl_lab.demo.run import step_batch
from dasrl_lab.tasks import preset

rows, tokens, repeats = (int(a) for a in (sys.argv[1:] + ["32", "128", "3"][len(sys.argv) - 1:]))
torch.set_num_threads(1)
model, tok = load_model("smollm2-135m")
tasks = preset("math").tasks(rows // 8)
prompts, _, pids = step_batch(tok, tasks, 8)
sampling = SamplingParams(temperature=1.0)
variants = {"plain": SessionConfig(speculate=False), "das": SessionConfig(speculate=True, counting=False)}
times = {k: [] for k in variants}
for rep in range(repeats):
    for name, cfg in variants.items():
        sess = RolloutSession(model, tok, cfg)  # fresh: no history, as a first step
        t0 = time.perf_counter()
        outs = sess.generate(prompts, problem_ids=pids, sampling=sampling, max_new_tokens=tokens)
        times[name].append(time.perf_counter() - t0)
        st = sess.stats()
        print(f"{name} rep {rep}: {times[name][-1]:.2f} s, forwards {st['forwards']}, drafted {st['drafted']}, "
              f"accepted {st['accepted']}", flush=True)
p, d = statistics.median(times["plain"]), statistics.median(times["das"])
print(f"median plain {p:.2f} s, das {d:.2f} s: das / plain {d / p:.3f}")
