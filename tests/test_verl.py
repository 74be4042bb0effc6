"""The VeRL router: DASLoadBalancer created through VeRL 0.9's own plugin loader (router_config_path YAML)
as a Ray actor, as VeRL creates it. Needs verl importable (the Makefile installs it without its
dependencies); skipped otherwise."""

from __future__ import annotations

import os
import time

import pytest

os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")
ray = pytest.importorskip("ray")
router = pytest.importorskip("verl.workers.rollout.router", reason="needs verl 0.9 (make test installs it)")

LONG = [[1, 10, 11], [1, 20, 21]]
SHORT = [[1, 30 + i] for i in range(6)]


@pytest.fixture(scope="module")
def cluster():
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=1, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    yield
    if started:
        ray.shutdown()


def _yaml(tmp_path, extra: str = "") -> str:
    path = tmp_path / "router.yaml"
    path.write_text("router_class: dasrl.integrations.verl.router.DASLoadBalancer\n" + extra)
    return str(path)


def _run(lb, rid: str, prompt: list[int], hold_s: float = 0.0) -> str:
    sid, _ = ray.get(lb.acquire_server.remote(request_id=rid, prompt_ids=prompt))
    if hold_s:
        time.sleep(hold_s)
    ray.get(lb.release_server.remote(server_id=sid, request_id=rid))
    return sid


def test_problems_stay_whole_and_long_ones_spread(cluster, tmp_path):
    servers = {"s0": None, "s1": None}
    lb = router.get_router_handle(servers, router_config_path=_yaml(tmp_path, "affinity_slack: 0.0\n"))
    assert ray.get(lb.require_acquire_fields.remote()) == ["prompt_ids"]
    # phase 1: learn service times (long problems held 0.3 s, short ones released at once)
    for i, p in enumerate(LONG):
        _run(lb, f"l{i}", p, hold_s=0.3)
    for i, p in enumerate(SHORT):
        _run(lb, f"s{i}", p)
    ray.get(lb.clear_sticky_cache.remote())
    # phase 2: 4 samples of each problem in flight at once; the two long problems must not share a server
    placed = {}
    for k in range(4):
        for j, p in enumerate(LONG + SHORT):
            sid, _ = ray.get(lb.acquire_server.remote(request_id=f"p2-{j}-{k}", prompt_ids=p))
            placed.setdefault(j, set()).add(sid)
    assert all(len(s) == 1 for s in placed.values())  # every sample of a problem on one server
    assert placed[0] != placed[1]
    status = ray.get(lb.get_status.remote())
    assert status["total_inflight"] == 4 * (len(LONG) + len(SHORT))
    # the stock balancer scatters a problem's samples (least in-flight per request)
    stock = router.get_router_handle(servers)
    sids = {ray.get(stock.acquire_server.remote(request_id=f"x{k}"))[0] for k in range(4)}
    assert len(sids) == 2


def test_unknown_yaml_field_is_named(cluster, tmp_path):
    from dasrl.integrations.verl.router import RouterConfig

    with pytest.raises(ValueError, match=r"unknown field\(s\) \['slack'\]"):
        RouterConfig.from_yaml({"router_class": "x", "slack": 1})
    lb = router.get_router_handle({"s0": None}, router_config_path=_yaml(tmp_path, "slack: 1\n"))
    with pytest.raises(ray.exceptions.RayActorError, match="slack"):
        ray.get(lb.get_status.remote())


def test_recipe_composes_into_verls_own_config():
    """The overrides the recipe prints are valid against VeRL 0.9.1's packaged ppo_trainer config."""
    import verl
    from hydra import compose, initialize_config_dir

    from dasrl.integrations.verl.recipe import _PAPER_MATH_7B, _ROUTER_YAML, Recipe

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose("ppo_trainer", overrides=_PAPER_MATH_7B + Recipe(num_speculative_tokens=8).overrides())
    rollout = cfg.actor_rollout_ref.rollout
    spec = rollout.engine_kwargs.vllm.speculative_config
    assert (spec.method, spec.model, spec.num_speculative_tokens) == (
        "custom_class", "dasrl.integrations.vllm.DASProposer", 8)
    assert rollout.engine_kwargs.vllm.additional_config.dasrl.policy == "das"
    assert rollout.n == 16 and cfg.data.max_response_length == 16384
    assert rollout.router_config_path == str(_ROUTER_YAML) and _ROUTER_YAML.is_file()


def test_packaged_router_yaml_loads_through_verl(cluster):
    from dasrl.integrations.verl.recipe import _ROUTER_YAML

    lb = router.get_router_handle({"s0": None, "s1": None}, router_config_path=str(_ROUTER_YAML))
    assert ray.get(lb.get_status.remote())["problems_this_phase"] == 0
