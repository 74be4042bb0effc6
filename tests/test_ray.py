"""DistributedRolloutSession on a local Ray (2 CPU actors, loopback): outputs equal a single-process
plain session's under the same seeds, problems stay whole on one worker, and a worker killed mid-step has
its requests re-run on the survivor with the same outputs, nothing lost or duplicated."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from dasrl.engine.sampling import SamplingParams  # noqa: E402
from dasrl.rollout.session import RolloutSession, SessionConfig  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    yield
    ray.shutdown()


def test_distributed_equals_local_and_survives_a_killed_worker(cluster, smollm, chat_prompts, tmp_path):
    from dasrl.integrations.ray import DistributedConfig, DistributedRolloutSession

    model, tok = smollm
    prompts = [p for p in (chat_prompts[0], chat_prompts[2], chat_prompts[6], chat_prompts[3]) for _ in range(2)]
    sp = SamplingParams()  # greedy: the exactness rung that holds across batch shapes in fp32
    local = RolloutSession(model, tok, SessionConfig(speculate=False))
    dist = DistributedRolloutSession("smollm2-135m", DistributedConfig(workers=2, router="length"))
    pids = {}

    for step in range(2):
        killed = []

        def kill_once(shares):
            if step == 1 and not killed:  # the first dispatch of step 1: kill a busy worker at once
                w = max(shares, key=lambda k: len(shares[k]))
                killed.append(w)
                ray.kill(dist.workers[w])

        got = dist.generate(prompts, sampling=sp, max_new_tokens=20, on_dispatch=kill_once)
        want = local.generate(prompts, sampling=sp, max_new_tokens=20)
        assert [r.completion_ids for r in got] == [r.completion_ids for r in want]
        assert [(r.problem_id, r.sample, r.seed) for r in got] == [(r.problem_id, r.sample, r.seed) for r in want]
        info = dist.history[-1]
        assert sum(info.worker_rows.values()) == len(prompts)  # each request completed exactly once
        if step == 0:
            assert info.rerun == 0 and len(info.worker_rows) == 2
            pids = {r.problem_id for r in got}
        else:
            assert info.dead == killed and info.rerun > 0
            assert killed[0] not in info.worker_rows  # it never returned: the survivor ran everything
        dist.end_step()
        local.end_step()

    # the dead worker was replaced: two live workers again, and the next step runs on both
    assert dist.live_workers == [0, 1]
    got = dist.generate(prompts, sampling=sp, max_new_tokens=20)
    want = local.generate(prompts, sampling=sp, max_new_tokens=20)
    assert [r.completion_ids for r in got] == [r.completion_ids for r in want]
    assert len(pids) == 4 and dist.stats()["steps"] == 3
    dist.save(tmp_path / "dist")
    assert (tmp_path / "dist" / "distributed.json").is_file() and (tmp_path / "dist" / "worker-0").is_dir()
    dist.shutdown()


def test_bad_config_names_the_value():
    from dasrl.integrations.ray import DistributedConfig

    with pytest.raises(ValueError, match="unknown router 'nearest'"):
        DistributedConfig(router="nearest")
    with pytest.raises(ValueError, match="workers must be >= 1, got 0"):
        DistributedConfig(workers=0)
