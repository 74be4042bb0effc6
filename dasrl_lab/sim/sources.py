"""Recorded rollouts for `dasrl whatif` (CHAMP, a VeRL rollout_data_dir, JSONL / Parquet rows, our traces;
docs/whatif.md, "Sources"), turned into the simulator's Responses (token ids).

Bad input raises SourceError naming the file, the line (1-based; a Parquet row index) and the field,
before anything is replayed or written; a FIFO, a device or a folder where a file should be is refused.
A row without a prompt replays with a one-token stand-in: a longer made-up prompt would feed the drafters
(which index prompts too) text nobody generated.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from dasrl.atomic import open_regular
from dasrl_lab.trace import FORMAT as TRACE_FORMAT
from dasrl_lab.trace import Response, TraceError, read_parquet, read_trace

Tokenize = Callable[[list[str]], list[list[int]]]


class SourceError(ValueError):
    """A recorded-rollouts source that cannot be used: file, line and field at fault."""


MAX_SOURCE_BYTES = 2**33
"""Largest source file read (8 GiB of JSONL or Parquet: far more rollouts than a replay holds in memory)."""
STAND_IN_PROMPT = (0,)
"""The prompt of a row recorded without one."""
_STEP_FILE = re.compile(r"[0-9]+\.jsonl")
"""A VeRL step file's name: ASCII digits only (str.isdigit() also takes '²', which int() refuses)."""


def _open(path: Path):
    """open_regular for a source file (a symlink the user made is followed); its refusals as SourceError."""
    try:
        return open_regular(path, MAX_SOURCE_BYTES, follow_symlinks=True)
    except (ValueError, OSError) as e:
        raise SourceError(f"{path}: cannot read it ({e})" if isinstance(e, OSError) else str(e)) from None


@dataclass(frozen=True)
class ChampSource:
    model: str = "GPT-4"
    variants: tuple[str, ...] = ()
    """The variants that play the steps, in order (empty = all 18 in the dataset's order)."""
    samples: int = 1
    """Variants per problem in one step (the step's siblings)."""
    problems: int = 0
    """The first N problems (0 = all 270)."""
    copies: bool = False
    """Keep a solution that repeats an earlier variant's verbatim ("No C w/o H" is the 0-Shot one for every
    problem); off, since no RL re-sample repeats hundreds of tokens and a copy inflates every history drafter."""


@dataclass
class _Row:
    step: int
    key: object  # problem id, or the prompt text when no id is given
    prompt: object  # str | list[int] | None
    response: object  # str | list[int]
    where: str = ""  # "file:line", for errors found after parsing (token ids outside the vocabulary)
    fields: tuple[str, str] = ("prompt", "response")  # the names of the prompt and response fields there


def _bad(file, line, field, msg) -> SourceError:
    return SourceError(f"{file}:{line}: field {field!r}: {msg}")


def _ids_or_text(v, file, line, field, *, optional=False):
    if v is None and optional:
        return None
    if isinstance(v, str):
        try:
            v.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate ("\\ud800" in the JSON): no tokenizer takes it
            raise _bad(file, line, field, f"text is not valid Unicode ({e.reason} at character {e.start})") from None
        return v
    if isinstance(v, (list, np.ndarray)) and all(
            isinstance(t, (int, np.integer)) and not isinstance(t, bool) and 0 <= t < 2**31 for t in v):
        return [int(t) for t in v]
    raise _bad(file, line, field, f"must be text or a list of token ids in [0, 2^31), got {str(v)[:60]!r}")


def _row(d, file, line, *, step_field="step", pid_field="problem_id", prompt_field="prompt",
         resp_field="response") -> _Row:
    if not isinstance(d, dict):
        raise SourceError(f"{file}:{line}: expected a JSON object, got {type(d).__name__}")
    step = d.get(step_field)
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise _bad(file, line, step_field, f"must be an integer >= 0, got {step!r}")
    if resp_field not in d:
        raise _bad(file, line, resp_field, "missing")
    resp = _ids_or_text(d[resp_field], file, line, resp_field)
    prompt = _ids_or_text(d.get(prompt_field), file, line, prompt_field, optional=True)
    pid = d.get(pid_field) if pid_field else None
    if pid is None:
        if prompt is None:
            why = (f"missing, and no {prompt_field!r} to key the problem by" if pid_field
                   else "missing (it keys the problem)")
            raise _bad(file, line, pid_field or prompt_field, why)
        pid = prompt if isinstance(prompt, str) else tuple(prompt)
    elif isinstance(pid, bool) or not isinstance(pid, (str, int, np.integer)):
        raise _bad(file, line, pid_field, f"must be a string or an integer, got {pid!r}")
    return _Row(int(step), pid, prompt, resp, f"{file}:{line}", (prompt_field, resp_field))


def _jsonl(path: Path, **fields) -> list[_Row]:
    rows = []
    with _open(path) as f:
        for i, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                d = json.loads(raw)
            except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError; deep nesting
                raise SourceError(f"{path}:{i}: not valid JSON ({type(e).__name__}: {e})") from None
            rows.append(_row(d, path, i, **fields))
    if not rows:
        raise SourceError(f"{path}: no rows")
    return rows


def _parquet(path: Path) -> list[_Row]:
    try:
        with _open(path) as f:
            table = read_parquet(f)  # no Arrow thread pools (trace.read_parquet)
    except SourceError:
        raise
    except Exception as e:  # pyarrow raises several types for a file that is not Parquet
        raise SourceError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None
    return [_row(d, path, i) for i, d in enumerate(table.to_pylist())]


def _is_trace(path: Path) -> bool:
    import pyarrow.parquet as pq

    files = [path] if not path.is_dir() else sorted(path.glob("*.parquet"))
    if not files:
        return False
    try:
        with open_regular(files[0], MAX_SOURCE_BYTES, follow_symlinks=True) as f:
            meta = pq.read_schema(f).metadata or {}
    except Exception:
        return False  # not Parquet at all: the generic reader names the problem
    return meta.get(b"format") == TRACE_FORMAT.encode()


def _tokenized(rows: list[_Row], tokenize: Tokenize, source: str, vocab_size: int | None) -> list[Response]:
    if vocab_size is not None:  # ids given as such must be the tokenizer's (text tokenizes into it)
        for r in rows:
            for field, v in zip(r.fields, (r.prompt, r.response)):
                if isinstance(v, list) and v and max(v) >= vocab_size:
                    raise SourceError(f"{r.where}: field {field!r}: token id {max(v)} is outside the tokenizer's "
                                      f"vocabulary (size {vocab_size})")
    texts = [r.response for r in rows if isinstance(r.response, str)]
    texts += [r.prompt for r in rows if isinstance(r.prompt, str)]
    ids = iter(tokenize(texts) if texts else [])
    resp = [next(ids) if isinstance(r.response, str) else r.response for r in rows]
    prompts = [next(ids) if isinstance(r.prompt, str) else r.prompt for r in rows]
    prompts = [p if p else list(STAND_IN_PROMPT) for p in prompts]  # none, "" or []
    out, seen = [], {}
    for r, p, a in zip(rows, prompts, resp):
        k = (r.step, r.key)
        seen[k] = seen.get(k, -1) + 1
        pid = r.key if isinstance(r.key, (str, int)) else "prompt-" + hashlib.blake2b(
            np.asarray(r.key, np.int64).tobytes(), digest_size=8).hexdigest()
        out.append(Response(step=r.step, problem_id=pid, sample=seen[k], prompt_ids=np.asarray(p, np.int32),
                            response_ids=np.asarray(a, np.int32)))
    if not out:
        raise SourceError(f"{source}: no rollouts")
    return out


def champ_rows(src: ChampSource) -> list[_Row]:
    from dasrl_lab import champ

    variants = src.variants or champ.VARIANTS
    unknown = [v for v in variants if v not in champ.VARIANTS]
    if unknown:
        raise SourceError(f"champ: unknown variant(s) {', '.join(map(repr, unknown))}; "
                          f"valid: {', '.join(champ.VARIANTS)}")
    if not 1 <= src.samples <= len(variants):
        raise SourceError(f"champ: samples per step must be in [1, {len(variants)}] (the variants), got {src.samples}")
    if src.problems < 0:
        raise SourceError(f"champ: problems must be >= 0 (0 = all), got {src.problems}")
    try:
        sols = champ.load_solutions(src.model)
    except ValueError as e:
        raise SourceError(f"champ: {e}") from None
    pids = list(sols)[: src.problems or None]
    rows, seen = [], {pid: set() for pid in pids}  # the texts of each problem's earlier variants
    for j, v in enumerate(variants):
        for pid in pids:
            text = sols[pid][v].text
            if src.copies or text not in seen[pid]:
                rows.append(_Row(j // src.samples, pid, sols[pid][v].prompt, text))
            seen[pid].add(text)
    return rows


def load(source: str | Path, tokenize: Tokenize, *, champ: ChampSource = ChampSource(),
         vocab_size: int | None = None) -> list[Response]:
    """Responses of `source` ('champ', a VeRL rollout_data_dir, a JSONL / Parquet file, or a dasrl trace),
    text tokenized by `tokenize`; token ids given as such must be below `vocab_size` (the tokenizer's)."""
    if str(source) == "champ":
        return _tokenized(champ_rows(champ), tokenize, "champ", vocab_size)
    path = Path(source)
    if not path.exists():
        raise SourceError(f"{path}: no such file or folder (or use 'champ')")
    if _is_trace(path):
        try:
            return read_trace(path, vocab_size=vocab_size).responses()
        except TraceError as e:
            raise SourceError(str(e)) from None
    if path.is_dir():
        files = sorted(path.glob("*.jsonl"))
        bad = [f.name for f in files if not _STEP_FILE.fullmatch(f.name)]
        if not files or bad:
            raise SourceError(f"{path}: a VeRL rollout_data_dir holds <step>.jsonl files only; "
                              + (f"found {', '.join(bad[:3])}" if bad else "found none"))
        rows = [r for f in sorted(files, key=lambda f: int(f.stem))
                for r in _jsonl(f, pid_field=None, prompt_field="input", resp_field="output")]
        return _tokenized(rows, tokenize, str(path), vocab_size)
    if path.suffix in (".jsonl", ".parquet"):
        rows = _jsonl(path) if path.suffix == ".jsonl" else _parquet(path)
        return _tokenized(rows, tokenize, str(path), vocab_size)
    raise SourceError(f"{path}: expected 'champ', a folder (VeRL rollout_data_dir or a dasrl trace), "
                      f"a .jsonl or a .parquet file")


def hf_tokenizer(folder: str | Path | None):
    """A local HF tokenizer folder (None: the embedded SmolLM2's); SourceError naming a folder it cannot load."""
    from transformers import AutoTokenizer

    if folder is None:
        from dasrl_lab.models import ensure_hf_folder

        return AutoTokenizer.from_pretrained(str(ensure_hf_folder()))
    folder = Path(folder)
    if not folder.is_dir():
        raise SourceError(f"tokenizer {folder}: " + ("no such folder" if not folder.exists() else
                                                      "not a folder (give the folder that holds tokenizer.json)"))
    if not any((folder / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json", "vocab.json",
                                                 "tokenizer.model")):
        raise SourceError(f"tokenizer {folder}: holds no tokenizer files (tokenizer.json, tokenizer_config.json, "
                          f"vocab.json or tokenizer.model)")
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError, JSON and tokenizers' own errors
        raise SourceError(f"tokenizer {folder}: cannot load it ({type(e).__name__}: {str(e)[:300]})") from None


def tokenize_with(tok) -> Tokenize:
    """Text -> token ids, no special tokens added (what a rollout's response holds)."""
    def tokenize(texts: Sequence[str]) -> list[list[int]]:
        return tok(list(texts), add_special_tokens=False)["input_ids"]
    return tokenize
