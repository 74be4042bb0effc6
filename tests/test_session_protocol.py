"""RolloutSession and the Ray session satisfy one Session protocol with the same arguments (no Ray started:
the classes are compared, and the Ray session's generate is checked to pass every argument to its workers)."""

import inspect

from dasrl.integrations.ray import DistributedRolloutSession, RolloutWorker
from dasrl.rollout import RolloutSession, Session

SHARED = ("prompts", "problem_ids", "seeds", "samples", "sampling", "max_new_tokens", "stop_token_ids", "stop_lines")


def _params(fn) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(fn).parameters)


def test_both_sessions_take_the_protocols_arguments_with_its_defaults():
    want = _params(Session.generate)
    for cls in (RolloutSession, DistributedRolloutSession):
        got = _params(cls.generate)
        for name in SHARED:
            assert name in got, f"{cls.__name__}.generate lacks {name}="
            assert got[name].kind == want[name].kind and got[name].default == want[name].default, (cls, name)
        for method in ("end_step", "stats", "save", "load", "close", "__enter__", "__exit__"):
            assert callable(getattr(cls, method, None)), f"{cls.__name__} lacks {method}"


def test_the_ray_worker_forwards_every_generate_argument():
    worker = _params(RolloutWorker.generate)
    assert set(SHARED) <= set(worker), sorted(set(SHARED) - set(worker))
