"""DistributedRolloutSession on a local Ray (2 CPU actors, loopback): every socket the local cluster
listens on is bound to loopback; outputs equal a single-process plain session's under the same seeds,
problems stay whole on one worker, and a worker killed mid-step has its requests re-run on the survivor
with the same outputs, nothing lost or duplicated."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

import os  # noqa: E402
import time  # noqa: E402

from dasrl.engine.sampling import SamplingParams  # noqa: E402
from dasrl.integrations.ray import _LOOPBACK, init_local, is_loopback  # noqa: E402
from dasrl.rollout.session import RolloutSession, SessionConfig  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    init_local(num_cpus=2, log_to_driver=False)
    yield
    ray.shutdown()


def _listening(psutil) -> dict[tuple[str, int], str]:
    """(ip, port) -> process name, for every LISTEN socket of this process and its descendants (the
    local cluster: gcs_server, raylet, agents, workers; the driver's own gRPC server is in this process)."""
    me = psutil.Process()
    out = {}
    for p in [me, *me.children(recursive=True)]:
        try:
            for c in p.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    out[(c.laddr.ip, c.laddr.port)] = p.name()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def test_every_local_ray_socket_listens_on_loopback_only(cluster):
    psutil = pytest.importorskip("psutil")

    @ray.remote(num_cpus=0)
    class Probe:  # an actor: a worker process with its own gRPC server
        def pid(self):
            return os.getpid()

    @ray.remote(num_cpus=0)
    def task():
        return os.getpid()

    actor = Probe.remote()
    pids = {ray.get(actor.pid.remote()), ray.get(task.remote())}
    assert ray.util.get_node_ip_address() == _LOOPBACK
    # agents start their servers a moment after the node is up: look until nothing new appears
    seen, stable = {}, 0
    for _ in range(40):
        now = _listening(psutil)
        stable = stable + 1 if now.keys() == seen.keys() else 0
        seen = now
        if stable >= 3:
            break
        time.sleep(0.25)
    exposed = {addr: name for addr, name in seen.items() if not is_loopback(addr[0])}
    assert not exposed, f"listening beyond loopback: {exposed}"
    names = set(seen.values())
    assert {"gcs_server", "raylet"} <= names, names  # the check saw the cluster, not nothing
    assert any(n.startswith("ray::") for n in names), names  # and its workers / agents
    assert pids  # the worker processes ran
    ray.kill(actor)


def test_init_local_refuses_what_would_not_be_local(cluster):
    with pytest.raises(RuntimeError, match="already initialised"):
        init_local()
    assert is_loopback("::ffff:127.0.0.1") and is_loopback("::1") and not is_loopback("0.0.0.0")
    assert not is_loopback("::") and not is_loopback("192.0.2.2")


@pytest.mark.slow
def test_distributed_equals_local_and_survives_a_killed_worker(cluster, tiny_chat, chat_prompts, tmp_path):
    """On the tiny Llama over SmolLM2's tokenizer, which each worker loads from its folder (SmolLM2 itself
    in the workers: the next test)."""
    from dasrl.integrations.ray import DistributedConfig, DistributedRolloutSession

    model, tok, folder = tiny_chat
    prompts = [p for p in (chat_prompts[0], chat_prompts[2], chat_prompts[6], chat_prompts[3]) for _ in range(2)]
    sp = SamplingParams(temperature=0.0)  # greedy: the exactness rung that holds across batch shapes in fp32
    local = RolloutSession(model, tok, SessionConfig(speculate=False))
    dist = DistributedRolloutSession(str(folder), DistributedConfig(workers=2, router="length"))
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
        assert info.new_tokens == sum(len(r.completion_ids) for r in got)  # the shares that came back, summed
        assert info.row_forwards == sum(r.forwards for r in got) and info.forwards >= len(info.worker_rows)
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
    # the same prompts again in the same step: fresh seeds, the ones a local session draws
    again = dist.generate(prompts[:2], sampling=sp, max_new_tokens=4)
    want_again = local.generate(prompts[:2], sampling=sp, max_new_tokens=4)
    assert [r.seed for r in again] == [r.seed for r in want_again]
    assert not {r.seed for r in again} & {r.seed for r in got}
    # the Session protocol's samples= and stop_lines= reach the workers as a local session takes them
    kw = dict(samples=[7, 9], sampling=sp, max_new_tokens=12, stop_lines=["."])
    by_index, want_index = dist.generate(prompts[:2], **kw), local.generate(prompts[:2], **kw)
    assert [(r.sample, r.seed, r.completion_ids) for r in by_index] == \
        [(r.sample, r.seed, r.completion_ids) for r in want_index]
    with pytest.raises(ValueError, match="sample index 7 .* drawn twice"):
        dist.generate(prompts[:1], samples=[7], sampling=sp, max_new_tokens=4)
    dist.save(tmp_path / "dist")
    assert (tmp_path / "dist" / "distributed.json").is_file() and (tmp_path / "dist" / "worker-0").is_dir()
    before = dist.step
    dist.load(tmp_path / "dist")
    assert dist.step == before == 2
    (tmp_path / "dist" / "distributed.json").write_text('{"format": "dasrl-distributed/1", "step": "x"}')
    with pytest.raises(ValueError, match="field 'step' must be an int >= 0, got 'x'"):
        dist.load(tmp_path / "dist")
    assert dist.step == 2  # the failed load changed nothing
    dist.close()


@pytest.mark.slow
def test_a_failed_load_or_set_weights_changes_no_worker(cluster, smollm, smollm_path, chat_prompts, tmp_path):
    """A save whose worker-1 part is damaged: load() raises naming worker 1, and worker 0 keeps its state
    (it used to load its own part first). Weights whose keys or shapes are not the model's are refused
    before any worker changes (they used to be accepted with strict=False, and the workers kept their old
    weights); the model's own keys go through and reach every worker."""
    import torch

    from dasrl.integrations.ray import DistributedConfig, DistributedRolloutSession

    model, _ = smollm
    dist = DistributedRolloutSession(smollm_path, DistributedConfig(workers=2, router="round_robin"))
    prompts = [chat_prompts[0], chat_prompts[2]] * 2
    sp = SamplingParams(temperature=0.0)

    def step():
        dist.generate(prompts, sampling=sp, max_new_tokens=8)
        dist.end_step()

    def worker_stats():
        return [ray.get(dist.workers[w].stats.remote()) for w in (0, 1)]

    step()
    dist.save(tmp_path / "a")
    step()
    before = worker_stats()
    assert [b["steps"] for b in before] == [2, 2]  # both workers hold state a load of "a" would change
    (tmp_path / "a" / "worker-1" / "session.json").write_text('{"format": "dasrl-session/2", "step": -1}')
    with pytest.raises(ValueError, match=r"not loaded: worker 1: ValueError: .*field 'step' must be an int in \[0, "):
        dist.load(tmp_path / "a")
    assert worker_stats() == before and dist.step == 2

    sd = model.state_dict()
    renamed = {("not.a.weight" if k == "model.norm.weight" else k): v for k, v in sd.items()}
    with pytest.raises(ValueError, match=r"missing 1: model.norm.weight; unexpected 1: not.a.weight\)"):
        dist.set_weights(renamed)
    with pytest.raises(ValueError, match=r"mis-shaped 1: model.norm.weight \(3,\) \(model: \(576,\)\)"):
        dist.set_weights({**sd, "model.norm.weight": torch.ones(3)})
    got = dist.generate(prompts, sampling=sp, max_new_tokens=8)
    assert any(set(r.completion_ids) != {0} for r in got)  # still the loaded model
    dist.set_weights({**sd, "model.norm.weight": torch.zeros_like(sd["model.norm.weight"])})
    got = dist.generate(prompts, sampling=sp, max_new_tokens=8)
    assert all(set(r.completion_ids) == {0} for r in got)  # zero hidden states: every logit 0, argmax 0
    dist.shutdown()


def test_init_local_refuses_an_address():
    with pytest.raises(ValueError, match="address='auto' is not allowed"):
        init_local(address="auto")


def test_bad_config_names_the_value():
    from dasrl.integrations.ray import DistributedConfig

    with pytest.raises(ValueError, match="unknown router 'nearest'"):
        DistributedConfig(router="nearest")
    with pytest.raises(ValueError, match="workers must be >= 1, got 0"):
        DistributedConfig(workers=0)
