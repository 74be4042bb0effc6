import torch, time, numpy as np, dataclasses, statistics
from dasrl.models import load_model
from dasrl.engine.engine import SpecEngine, EngineConfig
from dasrl.engine.cache import RowCache
from dasrl.engine.packing import pack_drafts
from dasrl.drafter.base import DraftBatch
from dasrl.engine.attention import attention_implementation
model, tok = load_model("smollm2-135m")
eng = SpecEngine(model, tok, EngineConfig(num_threads=1))
def inputs_for(b, ctx, qs):
    cache = RowCache.for_model(model, rows=b, capacity=ctx + max(qs)); cache.lengths[:] = ctx
    tokens = np.random.randint(0, 1000, sum(qs) - b).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(np.asarray(qs) - 1)]).astype(np.int64)
    parents = np.concatenate([np.arange(-1, k - 2, dtype=np.int32) for k in qs])
    d = DraftBatch(tokens, parents, np.ones(len(tokens)), offsets, np.zeros(b, np.int64))
    return cache, pack_drafts(pending=np.zeros(b, np.int64), lengths=cache.lengths.copy(), drafts=d)
for b, ctx, qs in [(2, 450, [17, 1]), (4, 400, [9, 9, 1, 1]), (16, 300, [5]*4 + [1]*12), (32, 150, [3]*8 + [1]*24)]:
    cache, inp = inputs_for(b, ctx, qs)
    gather = dataclasses.replace(inp, layout=dataclasses.replace(inp.layout, more_spans=()))
    res = {}
    with torch.inference_mode(), attention_implementation(model, eng.attn_name):
        for name, x in [('view', inp), ('gather', gather)] * 1:
            eng._forward(cache, x)
        ts = {'view': [], 'gather': []}
        for _ in range(6):
            for name, x in [('view', inp), ('gather', gather)]:
                t0 = time.perf_counter(); eng._forward(cache, x); ts[name].append(time.perf_counter() - t0)
        a, g = eng._forward(cache, inp), eng._forward(cache, gather)
    print(b, ctx, qs[:4], {k: round(statistics.median(v) * 1e3, 1) for k, v in ts.items()}, 'max|diff|', float((a - g).abs().max()))
