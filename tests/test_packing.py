"""The packed forward: hand-worked layouts, and its logits against plain per-sequence forwards (a tiny
random Llama: every row's pending token and draft nodes must see exactly their own cache and ancestors)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from hypothesis import given, settings, strategies as st  # noqa: E402

from dasrl.drafter.base import Draft, DraftBatch  # noqa: E402
from dasrl.engine.attention import attention_implementation  # noqa: E402
from dasrl.engine.cache import RowCache  # noqa: E402
from dasrl.engine.engine import SpecEngine  # noqa: E402
from dasrl.engine.packing import _closure, pack_drafts, pack_prompts  # noqa: E402


def test_closure_of_a_tree():
    # node 0 is the root; 1 and 2 are its children; 3 is a child of 2.
    anc, depth = _closure(np.array([[-1, 0, 0, 2]]))
    assert depth.tolist() == [[0, 1, 1, 2]]
    assert anc[0].astype(int).tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]


def test_pack_drafts_by_hand():
    # Row 0: cache 3, draft chain [7, 8]; row 1: cache 1, no draft; row 2: cache 2, tree 5 -> (6, 9).
    drafts = DraftBatch.from_drafts([Draft.chain([7, 8]), Draft.empty(),
                                     Draft(np.array([5, 6, 9], np.int32), np.array([-1, 0, 0], np.int32),
                                           np.ones(3), 1)])
    p = pack_drafts(pending=np.array([1, 2, 3]), lengths=np.array([3, 1, 2]), drafts=drafts)
    assert p.ids.tolist() == [[1, 7, 8, 2, 3, 5, 6, 9]]
    assert p.starts.tolist() == [0, 3, 4, 8]
    assert p.layout.rows.tolist() == [0, 0, 0, 1, 2, 2, 2, 2]
    assert p.layout.slots.tolist() == [3, 4, 5, 1, 2, 3, 4, 5]
    assert p.depth.tolist() == [0, 1, 2, 0, 0, 1, 2, 2]
    assert p.positions.tolist() == [[3, 4, 5, 1, 2, 3, 4, 4]]  # siblings 6 and 9 share a position
    assert p.layout.first.tolist() == [0, 3, 4]
    # First tokens see their cache and themselves.
    assert p.layout.first_mask[:, 0, 0].int().tolist() == [[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]]
    assert p.layout.more_rows.tolist() == [0, 2]
    assert p.layout.more_index.tolist() == [[1, 2, 0], [5, 6, 7]]  # row 0 padded with its first index
    assert p.layout.more_valid.tolist() == [[True, True, False], [True, True, True]]
    m = p.layout.more_mask[:, 0].int().tolist()
    assert m[0] == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0]]  # chain; pad sees slot 0
    assert m[1] == [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 1]]  # 9 does not see its sibling 6


def test_pack_prompts_is_causal():
    p = pack_prompts([[4, 5, 6], [7]])
    assert p.ids.tolist() == [[4, 5, 6, 7]]
    assert p.positions.tolist() == [[0, 1, 2, 0]]
    assert p.layout.more_rows.tolist() == [0]
    assert p.layout.more_mask[0, 0].int().tolist() == [[1, 1, 0], [1, 1, 1]]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tiny_llama, tiny_qwen2):
    model = {"llama": tiny_llama, "qwen2": tiny_qwen2}[request.param]()
    return model, SpecEngine(model)


def _draft(rng: np.random.Generator, n: int, tree: bool) -> Draft:
    toks = rng.integers(0, 97, n).astype(np.int32)
    parents = np.array([int(rng.integers(-1, i)) if tree else i - 1 for i in range(n)], np.int32)
    return Draft(toks, parents, np.ones(n), 1)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10**6), rows=st.integers(1, 5), tree=st.booleans())
def test_packed_logits_equal_plain_forwards(tiny, seed, rows, tree):
    model, engine = tiny
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 97, int(rng.integers(1, 12))).tolist() for _ in range(rows)]
    drafts = [_draft(rng, int(rng.integers(0, 6)), tree) for _ in range(rows)]
    pending = rng.integers(0, 97, rows)
    cache = RowCache.for_model(model, rows=rows, capacity=8)  # small: the step must grow it
    with torch.inference_mode(), attention_implementation(model, engine.attn_name):
        pre = pack_prompts(prompts)
        engine._forward(cache, pre, at=pre.starts[1:] - 1)
        cache.lengths[:rows] = [len(p) for p in prompts]
        batch = DraftBatch.from_drafts(drafts)
        step = pack_drafts(pending=pending, lengths=cache.lengths[:rows].copy(), drafts=batch)
        logits = engine._forward(cache, step)  # [N, V]
    with torch.inference_mode():  # the reference: the model as loaded, one plain forward per path
        for b in range(rows):
            d = drafts[b]
            for j in range(1 + len(d)):  # the pending token, then each node: its root path
                path, node = [], j - 1
                while node >= 0:
                    path.append(int(d.tokens[node]))
                    node = int(d.parents[node])
                seq = prompts[b] + [int(pending[b])] + path[::-1]
                ref = model(torch.tensor([seq])).logits[0, -1]
                got = logits[step.starts[b] + j]
                assert torch.allclose(got, ref, atol=1e-5, rtol=1e-4), (b, j, (got - ref).abs().max())
