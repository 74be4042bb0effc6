"""Task sets, presets, rewards, the demo's tail measure, and one small real demo run."""

from __future__ import annotations

import json

import pytest

from dasrl.demo.run import DemoConfig, tail_share
from dasrl.tasks import FAMILIES, PRESETS, make_tasks, preset, reward


def test_number_and_list_rewards_by_hand():
    assert reward("so 17 + 8 = 25", 25) == 1.0
    assert reward("the answer is 24", 25) == pytest.approx(0.5 * (1 - 1 / 26))
    assert reward("no idea", 25) == 0.0
    evens = (2, 4, 6, 8)
    assert reward("2, 4, 6, 8", evens) == 1.0
    assert reward("2, 4, 7, 8", evens) == 0.5  # 2 and 4 found in order; 6 never comes, so 8 is not reached
    assert reward("7 x 1 = 7\n7 x 2 = 14", (7, 14)) == 1.0  # table lines: the products are found in order
    assert reward(", ".join(str(i) for i in range(2, 20, 2)), evens) == 1.0  # 9 numbers: within 4x the list
    assert reward(", ".join(str(i) for i in range(2, 42, 2)), evens) == pytest.approx(1.0 - 0.5 * (20 - 16) / 4)
    assert reward(", ".join(str(i) for i in range(2, 200, 2)), evens) == 0.0  # rambling far past the list


def test_make_tasks_cycles_families_and_is_seeded():
    fams = PRESETS["long-tail"].families
    tasks = make_tasks(len(fams) * 2, seed=3, families=fams)
    assert [t.family for t in tasks[: len(fams)]] == [("list" if f in ("count", "evens", "table") else "number")
                                                     for f in fams]
    assert make_tasks(5, seed=3, families=fams) == tasks[:5]
    assert {t.question for t in tasks} != {t.question for t in make_tasks(len(fams) * 2, seed=4, families=fams)}
    count = next(t for t in tasks if t.question.startswith("Count"))
    assert count.answer == tuple(range(1, len(count.answer) + 1))
    with pytest.raises(ValueError, match="unknown task families"):
        make_tasks(2, families=("add", "nope"))
    with pytest.raises(ValueError, match="unknown preset 'x'"):
        preset("x")
    assert set(PRESETS["long-tail"].families) <= set(FAMILIES)


def test_tail_share_by_hand():
    # 4 rows: prefill ends at 1 s; then 1 s with 4 live, 1 s with 2, 2 s with 1 -> 2 of 4 s with <= 1 row.
    curve = [(1.0, 4), (2.0, 4), (3.0, 2), (5.0, 1)]
    assert tail_share(curve, 4) == pytest.approx(0.5)
    assert tail_share(curve[:1], 4) == 0.0


def test_demo_config_presets_and_overrides():
    short = DemoConfig.for_preset("short")
    assert (short.max_new_tokens, short.prompts, short.samples) == (128, 4, 8)
    cfg = DemoConfig.for_preset("long-tail", steps=2, max_new_tokens=64, temperature=None)
    assert cfg.max_new_tokens == 64 and cfg.temperature == PRESETS["long-tail"].temperature and cfg.steps == 2
    with pytest.raises(ValueError, match="--prompts must be an int >= 1, got 0"):
        DemoConfig.for_preset("short", prompts=0).validate()
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        DemoConfig.for_preset("short", policy="nope").validate()


def test_a_small_real_demo_run(tmp_path):
    pytest.importorskip("torch")
    from rich.console import Console

    from dasrl.demo.run import run_demo

    cfg = DemoConfig.for_preset("long-tail", steps=2, prompts=2, samples=2, max_new_tokens=24, out=str(tmp_path))
    out = run_demo(cfg, console=Console(width=80, quiet=True))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["identical_every_step"] is True and summary["preset"] == "long-tail"
    assert 0.0 <= summary["at_limit_fraction"] <= 1.0 and 0.0 <= summary["tail_share"] <= 1.0
    assert summary["speedup_from_second_visit"] > 0
    assert (out / "batch_collapse.png").stat().st_size > 0 and "identical" in (out / "report.md").read_text()
