"""CHAMP (champ-dataset 1.0.0, PyPI, MIT): 270 competition-math problems with answers and, per problem,
72 recorded solutions (4 models x 18 prompt variants) -- real reasoning text that nobody here wrote.

In `champ_dataset/dataset_files/v0.json` (1.0.0), `problems[id]` holds `_text`, `_answer`, `category` and
`conversations[f"{model}|{variant}"]["messages"]` ({role, text, error}). Every conversation ends with the
model's solution, a User turn "Now, summarize the answer above ..." and the summary, so the solution is the
message before that turn and its prompt the User turn before it (concept turns may come earlier). A solution
cut at the API's length limit carries error "LENGTH_CURRENT" (text kept; RL truncates too). The JSON
(~72 MB) is parsed once per process.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from dasrl.atomic import MAX_JSON_BYTES, read_json

MODELS = ("GPT-3.5", "GPT-4", "GPT-4 Turbo", "PaLM 2 Medium")
# The 18 prompt variants in the dataset's own order (a step of a replay plays one variant).
VARIANTS = (
    "0-Shot", "5-Shot", "1/3 Soln", "2/3 Soln", "No C w/o H", "No C w/ H", "Direct C w/o H", "Direct C w/ H",
    "Root C w/o H", "Root C w/ H", "Name C w/o H", "Name C w/ H", "Example C w/o H", "Example C w/ H",
    "Problem C w/o H", "Problem C w/ H", "Misleading C w/o H", "Misleading C w/ H",
)
_SUMMARIZE = "Now, summarize the answer above"


@dataclass(frozen=True)
class ChampProblem:
    id: str  # e.g. "P_Combinatorics_1"
    text: str  # the statement
    answer: str
    category: str  # Combinatorics, Inequality, Number-Theory, Polynomial, Sequence


@dataclass(frozen=True)
class ChampSolution:
    prompt: str  # the User turn that asked for this solution (statement plus the variant's additions)
    text: str  # the model's solution
    truncated: bool  # the API cut it at its length limit


@functools.lru_cache(maxsize=1)
def _raw() -> dict:
    try:
        from importlib import resources

        path = resources.files("champ_dataset") / "dataset_files" / "v0.json"
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            "CHAMP needs the champ-dataset package: pip install 'dasrl[champ]' (champ-dataset==1.0.0)") from exc
    return read_json(path, MAX_JSON_BYTES, follow_symlinks=True)["problems"]


def load_problems() -> list[ChampProblem]:
    """All 270 problems, in the dataset's order."""
    return [ChampProblem(id=pid, text=p["_text"], answer=p["_answer"], category=p["category"])
            for pid, p in _raw().items()]


def _solution(pid: str, key: str, messages: list[dict]) -> ChampSolution:
    for i in range(len(messages) - 1, 1, -1):
        m = messages[i]
        if m["role"] == "User" and (m["text"] or "").startswith(_SUMMARIZE):
            sol, ask = messages[i - 1], messages[i - 2]
            if not sol["role"].startswith("Model.") or ask["role"] != "User" or sol["text"] is None:
                break
            return ChampSolution(prompt=ask["text"], text=sol["text"], truncated=sol["error"] == "LENGTH_CURRENT")
    raise ValueError(f"CHAMP v0.json: problems[{pid!r}].conversations[{key!r}] has no solution turn "
                     f"before a '{_SUMMARIZE} ...' User turn")


def load_solutions(model: str) -> dict[str, dict[str, ChampSolution]]:
    """{problem id: {variant: ChampSolution}} of one model, problems and variants in the dataset's order."""
    if model not in MODELS:
        raise ValueError(f"unknown CHAMP model {model!r}; choose one of {', '.join(MODELS)}")
    out: dict[str, dict[str, ChampSolution]] = {}
    for pid, p in _raw().items():
        convs = p["conversations"]
        out[pid] = {v: _solution(pid, f"{model}|{v}", convs[f"{model}|{v}"]["messages"]) for v in VARIANTS}
    return out
