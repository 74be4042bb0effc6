"""Task sets, presets, rewards, the demo's tail measure, and one small real demo run."""

from __future__ import annotations

import json

import pytest

from dasrl_lab.demo.run import DemoConfig, tail_share
from dasrl_lab.tasks import (FAMILIES, FORMAT_CREDIT, MATH_INSTRUCTION, PRESETS, answers_match, as_number, champ_tasks,
                         make_tasks, normalise, preset, reward, stated_answer)


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
    fams = PRESETS["enumerations"].families
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
    assert set(PRESETS["enumerations"].families) <= set(FAMILIES)


def test_tail_share_by_hand():
    # 4 rows: prefill ends at 1 s; then 1 s with 4 live, 1 s with 2, 2 s with 1 -> 2 of 4 s with <= 1 row.
    curve = [(1.0, 4), (2.0, 4), (3.0, 2), (5.0, 1)]
    assert tail_share(curve, 4) == pytest.approx(0.5)
    assert tail_share(curve[:1], 4) == 0.0


def test_demo_config_presets_and_overrides():
    short = DemoConfig.for_preset("short")
    assert (short.max_new_tokens, short.prompts, short.samples) == (128, 4, 8)
    cfg = DemoConfig.for_preset("enumerations", steps=2, max_new_tokens=64, temperature=None)
    assert cfg.max_new_tokens == 64 and cfg.temperature == PRESETS["enumerations"].temperature and cfg.steps == 2
    assert (cfg.top_p, cfg.preset) == (0.95, "enumerations")
    math = DemoConfig()  # the default: the math preset's sizes and sampling
    assert (math.preset, math.samples, math.temperature, math.top_p) == ("math", 8, 0.6, 1.0)
    assert DemoConfig.for_preset("math", temperature=1.0).temperature == 1.0
    with pytest.raises(ValueError, match="long-tail"):
        DemoConfig.for_preset("long-tail")
    with pytest.raises(ValueError, match="--prompts must be an int >= 1, got 0"):
        DemoConfig.for_preset("short", prompts=0).validate()
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        DemoConfig.for_preset("short", policy="nope").validate()


def test_a_small_real_demo_run(tmp_path):
    pytest.importorskip("torch")
    from rich.console import Console

    from dasrl_lab.demo.run import run_demo

    cfg = DemoConfig(steps=2, prompts=2, samples=2, max_new_tokens=24, out=str(tmp_path))  # the math preset
    out = run_demo(cfg, console=Console(width=80, quiet=True))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["identical_every_step"] is True and summary["preset"] == "math"
    assert 0.0 <= summary["at_limit_fraction"] <= 1.0 and 0.0 <= summary["tail_share"] <= 1.0
    assert summary["speedup_from_second_visit"] > 0
    gpu = summary["gpu_prediction"]  # the same rollouts priced on a GPU profile by the whatif replay
    assert gpu["profile"] == "qwen2.5-7b-h100" and len(gpu["baseline_s"]) == len(gpu["das_s"]) == 2
    assert all(0 < x < 60 for x in gpu["baseline_s"] + gpu["das_s"])
    kl = [s["kl_to_initial"] for s in summary["steps"]]
    assert all(abs(x) < 1.0 for x in kl)  # finite and small after two tiny updates (values: test_grpo.py)
    assert (out / "batch_collapse.png").stat().st_size > 0 and "identical" in (out / "report.md").read_text()


def test_answer_normalisation_by_hand():
    assert normalise(" $\\boxed{\\frac{1}{2}}$. ") == "1/2"
    assert normalise("\\(x = -3\\)") == "-3"
    assert normalise("f(x)=0") == "f(x)=0"  # a function, not an assignment: kept
    assert normalise("No.") == "no"
    assert as_number("2,178") == 2178 and as_number("1/2") == as_number("0.5") == as_number(".5")
    assert as_number("1/0") is None and as_number("2^5") is None and as_number("12 apples") is None
    assert answers_match("\\boxed{0.5}", "1/2") and answers_match("-3.", "-3") and answers_match("NO", "No")
    assert not answers_match("2", "21") and not answers_match("1,2", "12")  # "1,2" is a list, not 12


def test_math_reward_by_hand():
    assert stated_answer("x\nThe answer is 5.\nThe answer is: 144.\n") == "144"  # the last stated answer
    assert stated_answer("So, the answer is 4. However, 22 more.") == "4"  # up to the end of the sentence
    assert stated_answer("The answer is 3.5.") == "3.5" and stated_answer("The answer is $x = 2$") == "$x = 2$"
    assert stated_answer("I think 144") is None
    assert reward("2+2=4.\nThe answer is 144.\n", "144") == 1.0
    assert reward("The answer is $\\frac{1}{2}$.", "1/2") == 1.0
    assert reward("The answer is 143.", "144") == FORMAT_CREDIT  # the form, wrong answer: the small credit
    assert reward("The answer is X.", "144") == 0.0  # the prompt's placeholder copied: no credit
    assert reward("144", "144") == 0.0  # right number, but not in the asked form


def test_math_preset_is_champ_statements():
    pytest.importorskip("champ_dataset")
    p = PRESETS["math"]
    assert (p.families, p.samples, p.temperature, p.top_p, p.stop_lines) == (("champ",), 8, 0.6, 1.0,
                                                                             ("The answer is", "the answer is"))
    tasks = champ_tasks(12)
    assert tasks[:4] == p.tasks(4) and all(t.system is None and t.family == "math" for t in tasks)
    assert all(t.question.endswith("\n" + MATH_INSTRUCTION) for t in tasks)
    assert all(as_number(normalise(t.answer)) is not None for t in tasks)  # exact rewards only
    assert len({t.question for t in tasks}) == 12
    first = {t.question for t in champ_tasks(5)}  # one per category (5), the shortest statement of each
    assert f"Find 2^32+1 mod 641.\n{MATH_INSTRUCTION}" in first  # CHAMP's shortest statement
    assert f"Find 3^105+4^105 mod 7.\n{MATH_INSTRUCTION}" not in first  # Number Theory too: not in the first 5
    with pytest.raises(ValueError, match="--prompts 1000: CHAMP has"):
        champ_tasks(1000)


def test_math_prompt_formatting():
    pytest.importorskip("torch")
    from dasrl_lab.models import ensure_hf_folder
    from transformers import AutoTokenizer

    from dasrl_lab.tasks import chat_ids

    tok = AutoTokenizer.from_pretrained(ensure_hf_folder("smollm2-135m"))
    task = champ_tasks(1)[0]
    text = tok.decode(chat_ids(tok, task.question, task.system))
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\n" + task.question + "<|im_end|>\n<|im_start|>assistant\n")
    assert 'as "The answer is X."' in MATH_INSTRUCTION
