"""Where a row's fp32 logits depend on the other rows of the batch, and what removes it (issue 16).

Shows, on the embedded SmolLM2 (fp32, one torch thread; run pinned, e.g. `taskset -c 0`):

1. `sdpa`: CPU scaled_dot_product_attention of one query row over L valid (unmasked) slots gives different
   bits for different view lengths S >= L (the masked tail is not neutral): the distinct results over
   S in [L, 2048]. So the first-token attention's view, the batch's longest context, is one source.
2. `logits`: rollouts of 32 prompts of mixed lengths (1-6 problems each: ~40-250 tokens) are recorded
   once, then teacher-forced through the engine's own packed prefill and plain-decoding steps; three
   rows' logits at every step are compared (torch.equal, max |diff|) alone, in a batch of 8, of 32, of
   32 permuted, and of 8 other rows. Per setting, each source switched off in turn:
   default; linears padded to >= 16 rows only; attention shapes from the row alone only; both
   (EngineConfig(batch_invariant=True)); and both but one attention group left as in the default.
3. `cost`: the engine's forward, batch_invariant off vs on (and on with 512-slot buckets: one view for
   all rows here), interleaved, median of the repeats: plain decoding at batch 1, 8, 32 on mixed contexts
   (64-448 cached tokens), every row with a 4-token chain draft at batch 8 and 32, the prefill of the 32
   prompts.

4. `flip`: the one flip of the full fidelity run (docs/benchmarks.md "Fidelity": request 93, position 59,
   batch 8 vs the reference batch of 96; T = 1, top-p 0.95, seeds 2000 + i) regenerated up to position
   60, batch_invariant off and on: the requests 88-95 that differ between the two batch shapes.

5. `spec`: with batch_invariant on, 8 requests decoded plainly and with the oracle drafter (budget 4, the
   true continuations): how many of the positions the speculative run drew at have logits equal
   (torch.equal) to plain decoding's, split into each row's first (pending) token and draft tokens.

    taskset -c 0 env OMP_NUM_THREADS=1 .venv/bin/python scripts/probes/batch_invariance.py [sdpa logits cost flip spec]
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

torch.set_num_threads(1)

STEPS = 24  # decode positions compared (0 = the prefill's)
TARGETS = (0, 3, 5)  # rows whose logits are compared


def sdpa_views() -> None:
    torch.manual_seed(0)
    q = torch.randn(1, 3, 3, 64)  # [B, Hkv, G, D]: SmolLM2's first-token shape
    k, v = torch.randn(1, 3, 2048, 64), torch.randn(1, 3, 2048, 64)  # [B, Hkv, S, D]
    for length in (5, 40, 100, 300, 700, 1500):
        outs = []
        for s in range(length, 2049):
            mask = (torch.arange(s) < length)[None, None, None, :]  # [1, 1, 1, S]
            o = F.scaled_dot_product_attention(q, k[:, :, :s], v[:, :, :s], attn_mask=mask, scale=0.125)
            if not any(torch.equal(o, p) for p in outs):
                outs.append(o)
        print(f"sdpa: L={length}: {len(outs)} distinct results over S in [{length}, 2048]", flush=True)


def load():
    from dasrl.bench.engine import PROBLEMS, chat_prompts
    from dasrl.models import load_model

    model, tok = load_model("smollm2-135m")
    texts = [" ".join(PROBLEMS[(i + j) % len(PROBLEMS)] for j in range(1 + i % 6)) for i in range(32)]
    return model, tok, chat_prompts(tok, texts)


def teacher_forced(engine, prompts, seqs, idx, *, first_shared=False, more_padded=False):
    """Logits [STEPS, V] of each row in idx: the engine's packed prefill, then plain steps fed seqs."""
    from dasrl.drafter.base import DraftBatch
    from dasrl.engine.cache import RowCache
    from dasrl.engine.packing import pack_drafts, pack_prompts

    def strip(inputs):  # switch one invariant attention group back to the default's shapes
        lay = inputs.layout
        if first_shared:  # one view of max L + 1 slots for every row, as the default layout
            s1 = int(lay.first_mask.sum(-1).max())
            lay = dataclasses.replace(lay, first_groups=(), first_mask=lay.first_mask[..., :s1])
        if more_padded:
            lay = dataclasses.replace(lay, more_views=())
        return dataclasses.replace(inputs, layout=lay)

    out = {i: [] for i in idx}
    b = len(idx)
    with engine.forward_context():
        cache = RowCache.for_model(engine.model, rows=b, capacity=max(len(prompts[i]) for i in idx) + 64)
        inputs = strip(pack_prompts([prompts[i] for i in idx], bucket=engine.attention_bucket))
        logits = engine._forward(cache, inputs, at=inputs.starts[1:] - 1)  # [B, V]
        cache.lengths[:b] = np.diff(inputs.starts)
        for r, i in enumerate(idx):
            out[i].append(logits[r].clone())
        for t in range(STEPS - 1):
            lengths = cache.lengths[:b].copy()
            inputs = strip(pack_drafts(pending=np.array([seqs[i][t] for i in idx]), lengths=lengths,
                                       drafts=DraftBatch.empty(b), bucket=engine.attention_bucket))
            logits = engine._forward(cache, inputs)  # [B, V]
            cache.lengths[:b] = lengths + 1
            for r, i in enumerate(idx):
                out[i].append(logits[r].clone())
    return out


def logits_by_setting() -> None:
    from dasrl.engine.engine import EngineConfig, SpecEngine
    from dasrl.engine.gemm import INVARIANT_PADDING, RowPadding
    from dasrl.engine.packing import INVARIANT_BUCKET
    from dasrl.engine.sampling import SamplingParams

    model, tok, prompts = load()
    print("prompt lengths", sorted(map(len, prompts)), flush=True)
    ref = SpecEngine(model, tok, EngineConfig(num_threads=1))
    seqs = [c.token_ids for c in ref.generate(prompts, seeds=list(range(32)), ignore_eos=True,
                                                sampling=SamplingParams(temperature=1.0, top_p=0.95),
                                                max_new_tokens=STEPS)]
    perm = np.random.default_rng(0).permutation(32).tolist()
    shapes = {"batch 8": list(range(8)), "batch 32": list(range(32)), "batch 32 permuted": perm,
              "8 others": [*TARGETS, 9, 14, 20, 27, 30]}

    def engine(pad: bool, attn: bool):
        e = SpecEngine(model, tok, EngineConfig(num_threads=1))
        e.row_padding = INVARIANT_PADDING if pad else RowPadding()
        e.attention_bucket = INVARIANT_BUCKET if attn else 0
        return e

    settings = [("default", engine(False, False), {}),
                ("linears padded to >= 16 only", engine(True, False), {}),
                ("attention from the row alone only", engine(False, True), {}),
                ("both (batch_invariant=True)", SpecEngine(model, tok, EngineConfig(num_threads=1,
                                                                                    batch_invariant=True)), {}),
                ("both, but first-token view shared", engine(True, True), {"first_shared": True}),
                ("both, but multi-token rows padded", engine(True, True), {"more_padded": True})]
    for name, e, kw in settings:
        alone = {}
        for i in TARGETS:
            alone.update(teacher_forced(e, prompts, seqs, [i], **kw))
        cells = []
        for shape, idx in shapes.items():
            got = teacher_forced(e, prompts, seqs, idx, **kw)
            pairs = [(alone[i][s], got[i][s]) for i in TARGETS for s in range(STEPS)]
            eq = sum(torch.equal(a, b) for a, b in pairs)
            mx = max(float((a - b).abs().max()) for a, b in pairs)
            cells.append(f"{shape}: {eq}/{len(pairs)} equal, max|d| {mx:.1e}")
        print(f"logits: {name}: " + "; ".join(cells), flush=True)


def cost(repeats: int = 7) -> None:
    from dasrl.drafter.base import DraftBatch
    from dasrl.engine.cache import RowCache
    from dasrl.engine.engine import EngineConfig, SpecEngine
    from dasrl.engine.packing import pack_drafts, pack_prompts

    model, tok, prompts = load()
    engines = {"off": SpecEngine(model, tok, EngineConfig(num_threads=1)),
               "on": SpecEngine(model, tok, EngineConfig(num_threads=1, batch_invariant=True)),
               "on, bucket 512": SpecEngine(model, tok, EngineConfig(num_threads=1, batch_invariant=True))}
    engines["on, bucket 512"].attention_bucket = 512  # one view for every row below 511 cached tokens
    rng = np.random.default_rng(0)

    def chains(batch: int, k: int) -> DraftBatch:  # a chain of k tokens per row
        return DraftBatch(np.ones(batch * k, np.int32), np.tile(np.arange(-1, k - 1, dtype=np.int32), batch),
                          np.ones(batch * k), np.arange(0, batch * k + 1, k, dtype=np.int64), np.zeros(batch, np.int64))

    shapes = [(f"batch {b}, plain", b, 0) for b in (1, 8, 32)] + [(f"batch {b}, drafts of 4", b, 4) for b in (8, 32)]
    shapes.append(("prefill of 32 prompts", 32, -1))
    for name, batch, k in shapes:
        ctx = rng.integers(64, 449, batch) if batch > 1 else np.array([256])  # [B] cached tokens per row (< 511)
        times = {e: [] for e in engines}
        cache = RowCache.for_model(model, rows=batch, capacity=512)  # one cache (memory), no growth in the timing
        for rep in range(repeats + 1):
            for label, e in engines.items():  # interleaved; a forward commits nothing, so the cache is reused
                cache.lengths[:] = 0 if k < 0 else ctx
                inputs = pack_prompts(prompts, bucket=e.attention_bucket) if k < 0 else pack_drafts(
                    pending=np.zeros(batch, np.int64), lengths=ctx.copy(),
                    drafts=chains(batch, k) if k else DraftBatch.empty(batch), bucket=e.attention_bucket)
                with e.forward_context():
                    t0 = time.perf_counter()
                    e._forward(cache, inputs, at=inputs.starts[1:] - 1 if k < 0 else None)
                    if rep:
                        times[label].append(time.perf_counter() - t0)
        med = {e: 1e3 * statistics.median(t) for e, t in times.items()}
        where = "prompts of 42-120 tokens" if k < 0 else f"contexts {int(ctx.min())}-{int(ctx.max())}"
        print(f"cost: {name} ({where}), median of {repeats}: "
              + ", ".join(f"{e} {ms:.1f} ms ({ms / med['off'] - 1:+.1%})" for e, ms in med.items()), flush=True)


def flip() -> None:
    from dasrl.bench.engine import PROBLEMS, chat_prompts
    from dasrl.engine.engine import EngineConfig, SpecEngine
    from dasrl.engine.sampling import SamplingParams
    from dasrl.models import load_model

    model, tok = load_model("smollm2-135m")
    prompts = [p for p in chat_prompts(tok, [PROBLEMS[i % 24] for i in range(24)]) for _ in range(4)]
    seeds = [2000 + i for i in range(96)]
    sampling = SamplingParams(temperature=1.0, top_p=0.95)
    chunk = list(range(88, 96))
    for on in (False, True):
        engine = SpecEngine(model, tok, EngineConfig(num_threads=1, batch_invariant=on))
        t0 = time.perf_counter()
        ref = engine.generate(prompts, seeds=seeds, sampling=sampling, max_new_tokens=60)
        t1 = time.perf_counter()
        eight = engine.generate([prompts[i] for i in chunk], seeds=[seeds[i] for i in chunk], sampling=sampling,
                                max_new_tokens=60)
        t2 = time.perf_counter()
        diffs = []
        for i, c in zip(chunk, eight):
            a, b = ref[i].token_ids, c.token_ids
            first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else
                         min(len(a), len(b)))
            if first is not None:
                diffs.append(f"request {i} at position {first}")
        print(f"flip: batch_invariant={on}: batch 8 vs 96, requests 88-95: "
              f"{', '.join(diffs) or 'all equal'} ({sum(len(c.token_ids) for c in eight)} tokens; "
              f"{t1 - t0:.0f} s for the 96, {t2 - t1:.0f} s for the 8)", flush=True)


def spec() -> None:
    import dasrl.engine.engine as engine_module
    from dasrl.drafter.baselines import OracleDrafter
    from dasrl.engine.engine import EngineConfig, SpecEngine
    from dasrl.engine.sampling import SamplingParams
    from dasrl.policy.base import FixedBudget

    model, tok, prompts = load()
    prompts, seeds = prompts[:8], list(range(500, 508))
    sampling = SamplingParams(temperature=1.0, top_p=0.95)
    engine = SpecEngine(model, tok, EngineConfig(num_threads=1, batch_invariant=True))
    real = engine_module.draw

    targets = engine._targets
    calls = [0]  # draws so far in this step: 0 = the pending tokens, then the draft nodes (engine._targets)

    def counted(*args, **kw):
        calls[0] = 0
        return targets(*args, **kw)

    def run(**kw):
        seen = {}

        def spy(logits, params, *, seeds, positions):  # logits [n, V]
            for row, s, p in zip(logits, seeds.tolist(), positions.tolist()):
                seen[s, p] = (calls[0] > 0, row.clone())
            calls[0] += 1
            return real(logits, params, seeds=seeds, positions=positions)

        engine_module.draw, engine._targets = spy, counted
        try:
            out = engine.generate(prompts, seeds=seeds, sampling=sampling, max_new_tokens=48, **kw)
        finally:
            engine_module.draw, engine._targets = real, targets
        return out, seen

    plain, base = run()
    oracle = OracleDrafter({i: c.token_ids for i, c in enumerate(plain)})
    out, seen = run(drafter=oracle, policy=FixedBudget(4))
    assert [c.token_ids for c in out] == [c.token_ids for c in plain]
    first, rest = [], []  # (equal, max |d|) per drawn position: pending tokens drawn first, then draft nodes
    for key, (draft, row) in seen.items():
        ref = base[key][1]
        (rest if draft else first).append((torch.equal(row, ref), float((row - ref).abs().max())))
    for name, got in (("pending tokens", first), ("draft tokens", rest)):
        print(f"spec: {name}: {sum(e for e, _ in got)}/{len(got)} equal to plain decoding's logits, "
              f"max |d| {max((d for _, d in got), default=0.0):.1e}", flush=True)


if __name__ == "__main__":
    parts = sys.argv[1:] or ["sdpa", "logits", "cost", "flip", "spec"]
    for part in parts:
        {"sdpa": sdpa_views, "logits": logits_by_setting, "cost": cost, "flip": flip, "spec": spec}[part]()
