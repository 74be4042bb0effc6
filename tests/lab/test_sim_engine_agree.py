"""The simulator's replay of a real engine run: both are lossless replays of the same tokens through the same
propose -> cap -> trim path and the same drafter, so per step they must agree exactly on drafted and
accepted tokens and on the number of forwards (the engine's prefill included)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from dasrl.drafter.base import DraftParams, problem_key  # noqa: E402
from dasrl.drafter.store import DraftStore, StoreConfig  # noqa: E402
from dasrl.engine.engine import EngineConfig, SpecEngine  # noqa: E402
from dasrl.engine.sampling import SamplingParams  # noqa: E402
from dasrl.policy.base import FixedBudget  # noqa: E402
from dasrl.rollout import StepSummary  # noqa: E402
from dasrl_lab.trace import Response  # noqa: E402
from dasrl_lab.sim.simulator import SimConfig, Simulator  # noqa: E402

NEW = 20


@pytest.fixture(scope="module")
def engine(tiny_llama):
    model = tiny_llama()
    with torch.no_grad():
        model.lm_head.weight.mul_(40)  # peaked distributions: T=1 samples mostly repeat, sometimes not
    return SpecEngine(model, config=EngineConfig(num_threads=1))


@pytest.mark.parametrize("branching", [1, 2])
def test_replay_agrees_with_the_engine_step_by_step(engine, branching):
    rng = np.random.default_rng(0)
    prompts = [p for p in (rng.integers(0, 97, int(rng.integers(4, 9))).tolist() for _ in range(3)) for _ in range(2)]
    store_cfg = StoreConfig(mode="problem+request", params=DraftParams(branching=branching))
    store = DraftStore(store_cfg)
    sim = Simulator(drafter="das", policy="fixed", policy_kw={"k": 4}, config=SimConfig(store=store_cfg))
    accepted_somewhere = rejected_somewhere = False
    for epoch in range(3):
        shapes = []
        out = engine.generate(prompts, seeds=[1000 * epoch + i for i in range(len(prompts))],
                              sampling=SamplingParams(temperature=1.0), drafter=store, policy=FixedBudget(4),
                              max_new_tokens=NEW, ignore_eos=True, req_ids=[(epoch, i) for i in range(len(prompts))],
                              on_step=lambda i: shapes.append((i.batch_size, i.tokens, i.kv_tokens, i.draft_kv_tokens)))
        store.end_step()
        run = StepSummary.of(engine.last_steps)
        responses = [Response(epoch, problem_key(p), i, np.array(p, np.int32), np.array(c.token_ids, np.int32))
                     for i, (p, c) in enumerate(zip(prompts, out))]
        st = sim.run_step(epoch, responses, max_new_tokens=NEW)
        assert (st.proposed, st.accepted, st.forwards) == (run.drafted, run.accepted, run.forwards), f"step {epoch}"
        assert st.shapes == shapes, f"step {epoch}"  # every forward priced on the engine's own shape
        assert st.tokens == run.new_tokens == len(prompts) * NEW
        accepted_somewhere |= run.accepted > 0
        rejected_somewhere |= run.accepted < run.drafted
    assert accepted_somewhere and rejected_somewhere  # both paths of verification took part


class OrderSpy(FixedBudget):
    """FixedBudget that records the order of the live requests it is asked about, step by step."""

    def __init__(self, k):
        super().__init__(k)
        self.orders = []

    def budgets(self, states):
        self.orders.append([s.req_id for s in states])
        return super().budgets(states)


def test_rows_leave_the_batch_in_the_engines_order(engine):
    """Rows that stop at different steps leave the live batch as in the engine (swap-remove), so a policy
    sees the same rows in the same order every step (its ties and its allowance depend on it)."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 97, int(rng.integers(4, 9))).tolist() for _ in range(8)]
    store_cfg = StoreConfig(mode="problem+request")
    spy_engine, spy_sim = OrderSpy(2), OrderSpy(2)
    out = engine.generate(prompts, seeds=list(range(len(prompts))), sampling=SamplingParams(temperature=1.0),
                          drafter=DraftStore(store_cfg), policy=spy_engine, max_new_tokens=NEW,
                          stop_token_ids=list(range(0, 97, 5)), req_ids=[(0, i) for i in range(len(prompts))])
    lengths = [len(c.token_ids) for c in out]
    assert len(set(lengths)) >= 3, lengths  # rows end at different steps: the order is exercised
    responses = [Response(0, problem_key(p), i, np.array(p, np.int32), np.array(c.token_ids, np.int32))
                 for i, (p, c) in enumerate(zip(prompts, out))]
    sim = Simulator(drafter=DraftStore(store_cfg), policy=spy_sim, config=SimConfig(store=store_cfg))
    sim.run_step(0, responses, max_new_tokens=NEW)
    assert spy_sim.orders == spy_engine.orders
