"""Task sets with verifiable answers, and the presets the demo, the engine bench and the experiments run.

`math` (the default) is the workload an RL user runs: CHAMP statements (dasrl_lab/champ.py) under the chat
template's default system turn, each asking for a final line "The answer is X." (MATH_INSTRUCTION), G = 8
samples at temperature 0.6 (the paper's: at RL's 1.0 a 135M model writes text no history predicts), top-p
1.0, stopped at the end of that line so that samples end where the model ends them. The reward compares
the stated answer with CHAMP's, plus a small credit for the fixed form.

The toy presets generate problems of two families, so that lengths differ by problem: **number** problems
(short answers, partial credit that falls with the distance) and **list** problems (long enumerations,
rewarded on how much of the expected sequence appears, in order). `enumerations` mixes them (a toy long
tail under a far limit); `short` is arithmetic only at 128 tokens (the limit cuts off the tail).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable

import numpy as np

SYSTEM = "You are a helpful assistant. Solve the problem step by step, then give the final answer as a number."
MATH_INSTRUCTION = 'Solve it briefly, then write the final answer on its own line as "The answer is X."'
"""Follows the statement in the user turn, under the model's own default system turn: on SmolLM2-135M a custom
system prompt asking for step-by-step work left 62% of samples at the 512-token limit, this 19%."""
ANSWER_PHRASE = "The answer is"
"""The fixed final-answer form; the math preset stops a sample at the end of the line that holds it."""
FORMAT_CREDIT = 0.1
"""Math reward for the fixed form stating a wrong number (a 135M model is rarely right, and GRPO needs reward
differences within a group); none without a number ("The answer is X." copied from the prompt)."""

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_ANSWER = re.compile(re.escape(ANSWER_PHRASE) + r":?[ \t]*([^\n]*?)(?=\.[ \t]|\.?[ \t]*(?:\n|$))", re.IGNORECASE)
"""X of "The answer is X": up to the end of its sentence (a period and a space) or of its line."""
_NUM = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)(/[+-]?\d+)?")


@dataclass(frozen=True)
class Task:
    question: str
    answer: int | tuple[int, ...] | str
    """A final number, the expected sequence of numbers (list problems), or CHAMP's answer text (math)."""
    family: str = "number"
    system: str | None = SYSTEM
    """The system turn of the chat prompt; None = the chat template's default."""


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
    """A named setting: which problems, how many, how long, how hot."""

    name: str
    families: tuple[str, ...]
    """Problem families, cycled over the prompts; ("champ",) = CHAMP statements (champ_tasks)."""
    prompts: int
    """Distinct problems."""
    samples: int
    """Samples per problem (GRPO group size)."""
    max_new_tokens: int
    """Generation limit per sample."""
    temperature: float
    """Sampling temperature."""
    top_p: float = 0.95
    """Nucleus sampling mass."""
    stop_lines: tuple[str, ...] = ()
    """A sample ends with the newline that closes a line holding one of these (the engine's stop_lines)."""

    def tasks(self, n: int | None = None, *, seed: int = 0) -> list[Task]:
        """The preset's first n problems (n = its prompts when None); seed draws the generated families."""
        n = self.prompts if n is None else n
        return champ_tasks(n) if self.families == ("champ",) else make_tasks(n, seed=seed, families=self.families)


PRESETS: dict[str, Preset] = {
    "math": Preset("math", ("champ",), prompts=4, samples=8, max_new_tokens=512, temperature=0.6, top_p=1.0,
                   stop_lines=(ANSWER_PHRASE, ANSWER_PHRASE.lower())),
    "enumerations": Preset("enumerations", ("add", "count", "stickers", "table", "minus", "shop", "apples", "times",
                                            "pencils", "minus"),
                           prompts=10, samples=4, max_new_tokens=512, temperature=0.6),
    "short": Preset("short", ("add", "times", "apples", "pencils", "stickers", "minus"),
                    prompts=4, samples=8, max_new_tokens=128, temperature=0.6),
}


def chat_ids(tokenizer, question: str, system: str | None = SYSTEM) -> list[int]:
    """The prompt token ids of a question under the model's chat template (system None: its default)."""
    msgs = [] if system is None else [{"role": "system", "content": system}]
    msgs.append({"role": "user", "content": question})
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


def champ_tasks(n: int) -> list[Task]:
    """n CHAMP problems whose answer is a number (so the reward can be exact): the shortest statement of
    each category in turn, then the next shortest, and so on (short statements, varied topics)."""
    from dasrl_lab.champ import load_problems

    if n < 1:
        raise ValueError(f"need at least one prompt, got --prompts {n}")
    by_cat: dict[str, list] = {}
    for p in sorted(load_problems(), key=lambda p: (len(p.text), p.id)):
        if as_number(normalise(p.answer)) is not None:
            by_cat.setdefault(p.category, []).append(p)
    order = [by_cat[c][i] for i in range(max(map(len, by_cat.values()))) for c in sorted(by_cat)
             if i < len(by_cat[c])]
    if n > len(order):
        raise ValueError(f"--prompts {n}: CHAMP has {len(order)} problems with a numeric answer")
    return [Task(f"{p.text}\n{MATH_INSTRUCTION}", p.answer, "math", None) for p in order[:n]]


def normalise(answer: str) -> str:
    """An answer's text for comparison: \\boxed{...} unwrapped, spaces, $, \\( \\) and a final period
    dropped, \\frac{a}{b} as a/b, a leading "x =" dropped, lower case."""
    s = answer.strip()
    m = re.search(r"\\boxed\{(.*)\}", s)
    if m:
        s = m.group(1)
    s = re.sub(r"\\d?frac\{([^{}]*)\}\{([^{}]*)\}", r"(\1)/(\2)", s)
    s = re.sub(r"\s+|\$|\\[()\[\]]|\\!|\\,", "", s).rstrip(".").lower()
    s = re.sub(r"^[a-z]\w*=(?=[^=]+$)", "", s)  # x=2 -> 2
    return re.sub(r"^\((-?[\d.]+)\)/\((-?[\d.]+)\)$", r"\1/\2", s)  # (1)/(2) -> 1/2


def as_number(text: str) -> Fraction | None:
    """An integer, decimal or fraction a/b (thousands commas allowed) as an exact Fraction; None otherwise."""
    t = text.replace(",", "") if re.fullmatch(r"[+-]?\d{1,3}(,\d{3})+", text) else text
    if not _NUM.fullmatch(t):
        return None
    num, _, den = t.partition("/")
    try:
        return Fraction(num) / Fraction(den) if den else Fraction(num)
    except ZeroDivisionError:
        return None


def stated_answer(completion: str) -> str | None:
    """The X of the last "The answer is X" (any case), or None without one."""
    found = _ANSWER.findall(completion)
    return found[-1] if found else None


def answers_match(pred: str, gold: str) -> bool:
    """Equal as numbers when both parse as numbers, else equal as normalised text."""
    p, g = normalise(pred), normalise(gold)
    pn, gn = as_number(p), as_number(g)
    return pn == gn if pn is not None and gn is not None else p == g


def math_reward(completion: str, answer: str) -> float:
    """1 for the right answer in the fixed form, FORMAT_CREDIT for the form stating a wrong number, else 0."""
    pred = stated_answer(completion)
    if pred is None:
        return 0.0
    if answers_match(pred, answer):
        return 1.0
    return FORMAT_CREDIT if as_number(normalise(pred)) is not None else 0.0


def reward(completion: str, answer: int | tuple[int, ...] | str) -> float:
    """Math problems (a str answer): math_reward. Number problems: 1 for the right final number, partial
    credit that falls with the distance, 0 without a number. List problems: the fraction of the expected
    sequence found in order, less a penalty for numbers past its end."""
    if isinstance(answer, str):
        return math_reward(completion, answer)
    nums = NUMBER.findall(completion)
    if isinstance(answer, tuple):
        found = 0
        for x in map(float, nums):  # greedy in-order match: each expected number found after the previous one
            if found < len(answer) and x == answer[found]:
                found += 1
        extra = max(0, len(nums) - 4 * len(answer)) / len(answer)  # rambling on far past the list
        return max(0.0, found / len(answer) - 0.5 * extra)
    if not nums:
        return 0.0
    pred = float(nums[-1])
    if pred == answer:
        return 1.0
    return 0.5 * max(0.0, 1.0 - abs(pred - answer) / (abs(answer) + 1.0))
