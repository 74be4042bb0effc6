"""A prompt set with verifiable answers (arithmetic and short word problems) and its reward."""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

SYSTEM = "You are a helpful assistant. Solve the problem step by step, then give the final answer as a number."

TEMPLATES = [
    ("What is {a} + {b}?", lambda a, b: a + b),
    ("What is {a} times {b}?", lambda a, b: a * b),
    ("Tom has {a} apples and buys {b} more. How many apples does he have now?", lambda a, b: a + b),
    ("A box holds {a} pencils. How many pencils are in {b} boxes?", lambda a, b: a * b),
    ("Sara had {a} stickers and gave away {b}. How many stickers does she have left?", lambda a, b: a - b),
    ("What is {a} minus {b}?", lambda a, b: a - b),
]

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass(frozen=True)
class Task:
    question: str
    answer: int


def make_tasks(n: int, *, seed: int = 0) -> list[Task]:
    if n < 1:
        raise ValueError(f"need at least one prompt, got --prompts {n}")
    rng = np.random.default_rng(seed)
    tasks = []
    for i in range(n):
        text, fn = TEMPLATES[i % len(TEMPLATES)]
        a, b = int(rng.integers(5, 30)), int(rng.integers(2, 10))
        tasks.append(Task(text.format(a=a, b=b), int(fn(a, b))))
    return tasks


def reward(completion: str, answer: int) -> float:
    """1 for the right final number; partial credit that falls with the distance; 0 without a number."""
    nums = NUMBER.findall(completion)
    if not nums:
        return 0.0
    pred = float(nums[-1])
    if pred == answer:
        return 1.0
    return 0.5 * max(0.0, 1.0 - abs(pred - answer) / (abs(answer) + 1.0))
