"""Task sets with verifiable answers, and the presets the demo, the engine bench and the experiments run.

Two families of problems, so that lengths differ by problem the way RL prompts do:

- **number** problems (arithmetic, one- and multi-step word problems): short answers, rewarded on the
  final number (partial credit that falls with the distance);
- **list** problems (count, list the even numbers, a multiplication table): long, enumerating answers,
  rewarded on how much of the expected sequence appears, in order.

The `long-tail` preset mixes them: most samples end early, a few problems run many times longer, and the
generation limit sits far above the median (the paper's regime). `short` is the earlier demo setting
(arithmetic only, 128 tokens): the limit cuts off the tail there, and DAS breaks even.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import numpy as np

SYSTEM = "You are a helpful assistant. Solve the problem step by step, then give the final answer as a number."

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass(frozen=True)
class Task:
    question: str
    answer: int | tuple[int, ...]
    """A final number, or the expected sequence of numbers (list problems)."""
    family: str = "number"


def _number(text: str, fn: Callable[[int, int], int]) -> Callable[[np.random.Generator], Task]:
    def make(rng: np.random.Generator) -> Task:
        a, b = int(rng.integers(5, 30)), int(rng.integers(2, 10))
        return Task(text.format(a=a, b=b), int(fn(a, b)), "number")
    return make


def _multi_step(rng: np.random.Generator) -> Task:
    p, q, a, b = (int(rng.integers(2, 9)) for _ in range(4))
    return Task(f"A shop sells pens at {p} dollars each and notebooks at {q} dollars each. Tom buys {a} pens "
                f"and {b} notebooks. How much does he spend in total?", p * a + q * b, "number")


def _count(rng: np.random.Generator) -> Task:
    n = int(rng.integers(30, 61))
    return Task(f"Count from 1 to {n}, separated by commas.", tuple(range(1, n + 1)), "list")


def _evens(rng: np.random.Generator) -> Task:
    n = 2 * int(rng.integers(15, 31))
    return Task(f"List all the even numbers from 2 to {n}, separated by commas.", tuple(range(2, n + 1, 2)), "list")


def _table(rng: np.random.Generator) -> Task:
    a = int(rng.integers(3, 10))
    return Task(f"Write the multiplication table of {a}, from {a} x 1 = {a} to {a} x 12 = {12 * a}, one line each.",
                tuple(a * k for k in range(1, 13)), "list")


FAMILIES: dict[str, Callable[[np.random.Generator], Task]] = {
    "add": _number("What is {a} + {b}?", lambda a, b: a + b),
    "times": _number("What is {a} times {b}?", lambda a, b: a * b),
    "apples": _number("Tom has {a} apples and buys {b} more. How many apples does he have now?", lambda a, b: a + b),
    "pencils": _number("A box holds {a} pencils. How many pencils are in {b} boxes?", lambda a, b: a * b),
    "stickers": _number("Sara had {a} stickers and gave away {b}. How many stickers does she have left?",
                        lambda a, b: a - b),
    "minus": _number("What is {a} minus {b}?", lambda a, b: a - b),
    "shop": _multi_step,
    "count": _count,
    "evens": _evens,
    "table": _table,
}
"""Problem generators by name: each draws one task from a seeded generator."""


@dataclass(frozen=True)
class Preset:
    """A named demo setting: which problems, how many, how long, how hot."""

    name: str
    families: tuple[str, ...]
    """Problem families, cycled over the prompts."""
    prompts: int
    """Distinct problems."""
    samples: int
    """Samples per problem (GRPO group size)."""
    max_new_tokens: int
    """Generation limit per sample."""
    temperature: float
    """Sampling temperature."""


PRESETS: dict[str, Preset] = {
    "long-tail": Preset("long-tail", ("add", "count", "stickers", "table", "minus", "shop", "apples", "times",
                                      "pencils", "minus"),
                        prompts=10, samples=4, max_new_tokens=512, temperature=0.6),
    "short": Preset("short", ("add", "times", "apples", "pencils", "stickers", "minus"),
                    prompts=4, samples=8, max_new_tokens=128, temperature=0.6),
}


def chat_ids(tokenizer, question: str, system: str = SYSTEM) -> list[int]:
    """The prompt token ids of a question under the model's chat template."""
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(PRESETS)}") from None


def make_tasks(n: int, *, seed: int = 0, families: tuple[str, ...] = PRESETS["short"].families) -> list[Task]:
    """n tasks, cycling over `families`, drawn from a generator seeded with `seed`."""
    if n < 1:
        raise ValueError(f"need at least one prompt, got --prompts {n}")
    unknown = [f for f in families if f not in FAMILIES]
    if unknown or not families:
        raise ValueError(f"unknown task families {unknown}; valid: {', '.join(FAMILIES)}")
    rng = np.random.default_rng(seed)
    return [FAMILIES[families[i % len(families)]](rng) for i in range(n)]


def reward(completion: str, answer: int | tuple[int, ...]) -> float:
    """Number problems: 1 for the right final number, partial credit that falls with the distance, 0
    without a number. List problems: the fraction of the expected sequence found in order, less a
    penalty for numbers past its end."""
    nums = NUMBER.findall(completion)
    if isinstance(answer, tuple):
        return _list_reward([float(x) for x in nums], answer)
    if not nums:
        return 0.0
    pred = float(nums[-1])
    if pred == answer:
        return 1.0
    return 0.5 * max(0.0, 1.0 - abs(pred - answer) / (abs(answer) + 1.0))


def _list_reward(nums: list[float], expected: tuple[int, ...]) -> float:
    i = 0
    for x in nums:  # greedy in-order match: each expected number found after the previous one
        if i < len(expected) and x == expected[i]:
            i += 1
    found = i / len(expected)
    extra = max(0, len(nums) - 4 * len(expected)) / len(expected)  # rambling on far past the list
    return max(0.0, found - 0.5 * extra)
