from dasrl.policy.allowance import ForwardAllowance, allowance_for
from dasrl.policy.base import FixedBudget, RequestState
from dasrl.policy.latency import LatencyModel


def _state(i, generated, cls):
    s = RequestState(req_id=i, problem_id=0, prompt_len=5, max_new_tokens=100, generated=generated)
    s.classes.append(cls)
    return s


def test_allowance_pays_for_the_padded_width():
    pol = ForwardAllowance(FixedBudget(8), max_tokens=12)
    assert pol.budgets([_state(i, 0, "long") for i in range(4)]) == [3, 3, 3, 3]  # 4 rows x 3 = 12
    assert pol.budgets([_state(i, 0, "long") for i in range(13)]) == [0] * 13  # full batch: plain decoding
    assert pol.budgets([_state(0, 50, "long")]) == [8]  # a lone straggler: its full cap


def test_allowance_is_c_base_over_c_tok():
    assert allowance_for(LatencyModel(0.05, 0.0025)) == 20
    assert allowance_for(LatencyModel(0.02, 0.0)) > 10**5
