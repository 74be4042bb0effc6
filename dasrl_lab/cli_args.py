"""Checks on `dasrl` options that run while typer parses them, before a command does any work: typer callbacks
raising typer.BadParameter, which typer reports as one usage error naming the option and the value (exit 2,
no traceback), e.g. `typer.Option(3, callback=between(1, MAX_STEPS))`. `user_errors` turns an error found
only once the work has started (weights that do not load) into the same usage error.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import stat
from pathlib import Path
from typing import Callable, Iterator

import typer

# Upper bounds: far above any run this project makes, far below what would exhaust memory or time.
MAX_STEPS = 10_000
"""RL steps of a run, a simulation or a workload."""
MAX_SCALE = 100.0
"""Scale of a synthetic workload's lengths (1 = as defined; 100 turns paper-math's 16K limit into 1.6M)."""
MIN_SCALE = 1 / MAX_SCALE
"""Smallest scale (1e-300 made every length 1 token: a workload of nothing, silently)."""
MAX_COUNT = 100_000
"""Prompts, samples, requests and tokens per sample (draft budgets: dasrl.drafter.base.MAX_DRAFT)."""
MAX_WORKERS = 4096
"""Simulated rollout workers (4096 take ~5 s on the tiny workload; 100000 ran for minutes)."""


def between(low: float, high: float | None = None, *, above: bool = False) -> Callable:
    """A callback refusing NaN, a number below `low` (or equal to it, if `above`) and above `high` (if given)."""
    def check(value):
        if value is None:
            return value
        if isinstance(value, float) and math.isnan(value):
            raise typer.BadParameter(f"must be a number, got {value}")
        if value < low or (above and value == low):
            raise typer.BadParameter(f"must be {'>' if above else '>='} {low}, got {value}")
        if high is not None and value > high:
            raise typer.BadParameter(f"must be <= {high}, got {value}")
        return value
    return check


def max_threads() -> int:
    """The cores this process may run on: more torch threads only slow a run down (100000 crashed torch)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


ACTOR_BYTES = 512 << 20
"""Memory one model-loading worker process takes (SmolLM2-135M fp32: 335 MB RSS after load_model, measured
2026-12-06, plus a Ray actor's runtime and KV cache)."""


def max_actors() -> int:
    """Most model-loading worker processes this machine's memory holds (at least 1)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(1, total // ACTOR_BYTES)


def threads(value: int | None) -> int | None:
    """--threads: 1 .. the cores available (None: the default)."""
    return between(1, max_threads())(value)


def _writable(folder: Path, value: object) -> None:
    """Create and delete a file in `folder` (os.access says yes to root, even on a read-only filesystem)."""
    probe = folder / f".dasrl-probe-{secrets.token_hex(4)}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.unlink(probe)
    except OSError as e:
        raise typer.BadParameter(f"{value}: cannot write in {folder} ({e.strerror})") from None


def _mode(path: Path, value: object) -> int | None:
    """os.stat(path).st_mode, None where nothing is there; any other failure (a name too long, no permission)
    is a usage error naming it."""
    try:
        return os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise typer.BadParameter(f"{value}: {e.strerror}") from None


def _nearest_folder(path: Path, value: object) -> Path:
    """The nearest existing ancestor of `path`, which must be a folder (missing ones are made on write)."""
    parent = path.absolute().parent
    while (mode := _mode(parent, value)) is None:
        parent = parent.parent
    if not stat.S_ISDIR(mode):
        raise typer.BadParameter(f"{value}: {parent} is a file, not a folder")
    return parent


def _not_empty(value: object) -> None:
    if not str(value).strip():
        raise typer.BadParameter("must not be empty (an empty path is the current folder); give a path")


def output_file(value: Path | None) -> Path | None:
    """A file a command writes (atomically, making missing folders): not a folder, under a writable one, and
    if there, a regular file: a device or a FIFO (`--json /dev/stdout`) would be replaced, not written into."""
    if value is None:
        return value
    _not_empty(value)
    path = Path(value)
    mode = _mode(path, value)
    if mode is not None and stat.S_ISDIR(mode):
        raise typer.BadParameter(f"{value} is a folder; give a file name")
    if mode is not None and not stat.S_ISREG(mode):
        raise typer.BadParameter(f"{value}: not a regular file (mode {stat.filemode(mode)}: a device, a FIFO or a "
                                 f"socket); an output is written as a new file, which would replace it")
    if len(os.fsencode(path.name)) > 255:  # fsencode: a non-UTF-8 byte of argv arrives as a surrogate
        raise typer.BadParameter(f"{value}: a file name may hold at most 255 bytes")
    _writable(_nearest_folder(path, value), value)
    return value


def output_folder(value: Path | str | None) -> Path | str | None:
    """A folder a command writes into (made if missing): not a file, and writable."""
    if value is None:
        return value
    _not_empty(value)
    path = Path(value)
    mode = _mode(path, value)
    if mode is not None and not stat.S_ISDIR(mode):
        raise typer.BadParameter(f"{value} is a file; give a folder")
    if any(len(os.fsencode(part)) > 255 for part in path.parts):
        raise typer.BadParameter(f"{value}: a folder name may hold at most 255 bytes")
    _writable(path if mode is not None else _nearest_folder(path, value), value)
    return value


def input_file(value: Path | None) -> Path | None:
    """A file a command reads: it must exist and be a regular file (a FIFO would block, a device never end)."""
    if value is None:
        return value
    try:
        mode = os.stat(value).st_mode
    except FileNotFoundError:
        raise typer.BadParameter(f"{value}: no such file") from None
    except OSError as e:
        raise typer.BadParameter(f"{value}: {e.strerror}") from None
    if stat.S_ISDIR(mode):
        raise typer.BadParameter(f"{value}: is a folder, not a file")
    if not stat.S_ISREG(mode):
        raise typer.BadParameter(f"{value}: not a regular file (mode {stat.filemode(mode)}: a FIFO or a device); "
                                 f"refused")
    return value


def model_source(value: str) -> str:
    """--model: an embedded model name, a folder with a config.json and weights, or a hub id (org/name)."""
    from dasrl_lab.models import EMBEDDED, resolve_source

    if value in EMBEDDED:
        return value  # resolving would convert it now (seconds); it is always loadable
    if Path(value).is_file():
        raise typer.BadParameter(f"{value!r} is a file; give a model folder, a hub id or one of {sorted(EMBEDDED)}")
    try:
        source, _ = resolve_source(value)
    except FileNotFoundError as e:
        raise typer.BadParameter(f"{e}; give a model folder, a hub id or one of {sorted(EMBEDDED)}") from None
    folder = Path(source)
    if not folder.is_dir():  # a hub id: known to the local cache, or to the hub (one request, no retries)
        reason = _unknown_hub_id(source)
        if reason is not None:
            raise typer.BadParameter(f"{value!r} is not an embedded model ({', '.join(sorted(EMBEDDED))}), a "
                                     f"local model folder, or a hub id that can be loaded: {reason}")
        return value
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise typer.BadParameter(f"{folder / 'config.json'} is not a readable JSON file ({e})") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise typer.BadParameter(f"{folder / 'config.json'} names no model_type: not a Hugging Face model config")
    if not any(any(folder.glob(p)) for p in ("*.safetensors", "*.bin")):
        raise typer.BadParameter(f"model folder {value!r} holds no weights (*.safetensors or *.bin)")
    return value


def _unknown_hub_id(repo_id: str) -> str | None:
    """Why `repo_id` cannot be loaded from the Hugging Face hub (None: it can), asked before any work:
    transformers finds out only when the model loads, after ~40 s of retries offline."""
    from huggingface_hub import model_info, try_to_load_from_cache

    try:
        if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
            return None
        model_info(repo_id, timeout=10)
        return None
    except Exception as e:  # a malformed id, a repository the hub does not know, no network: all one answer
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def temperature(value):
    """--temperature (one value or a list): what SamplingParams takes."""
    if value is None:
        return value
    from dasrl.engine import SamplingParams

    with user_errors():
        for t in value if isinstance(value, (list, tuple)) else [value]:
            SamplingParams(temperature=t)
    return value


def device(value: str | None) -> str | None:
    """--device: cpu, cuda or cuda:N, and present on this machine."""
    from dasrl_lab.models import resolve_device

    if value is not None:
        with user_errors():
            resolve_device(value)
    return value


def write_json_out(json_out: Path | None, doc: object, console) -> None:
    """--json: write the results (when given) atomically and say where."""
    from dasrl.atomic import write_json

    if json_out is not None:
        write_json(json_out, doc)
        console.print(f"wrote {json_out}")


@contextlib.contextmanager
def user_errors(option: str | None = None) -> Iterator[None]:
    """Report a ValueError/OSError raised by the work on `option`'s value (None: the option being parsed) as a
    usage error on that option."""
    try:
        yield
    except (ValueError, OSError) as e:
        raise typer.BadParameter(str(e), param_hint=None if option is None else f"'{option}'") from None


def preset_name(value: str | None) -> str | None:
    """--preset: a task preset of dasrl_lab/tasks.py, given back as its name."""
    if value is None:
        return value
    from dasrl_lab.tasks import preset

    with user_errors():
        return preset(value).name


def dtype_name(value: str) -> str:
    """--dtype: fp32 | bf16."""
    if value not in ("fp32", "bf16"):
        raise typer.BadParameter(f"must be fp32 or bf16, got {value!r}")
    return value


def json_option(help: str = "Write the results as JSON here."):
    """--json FILE, checked as output_file."""
    return typer.Option(None, "--json", help=help, callback=output_file)


def model_option(help: str = "Model: the embedded default, a local HF folder, or a hub id.",
                 default: str = "smollm2-135m"):
    """--model, checked as model_source."""
    return typer.Option(default, help=help, callback=model_source)


def rows_table(title: str, rows: list[dict], columns):
    """A rich Table of dict rows; columns: (key, header, format) triples; a missing or None value shows as -."""
    from rich.table import Table

    table = Table(title=title)
    for _, name, _ in columns:
        table.add_column(name, justify="right")
    for r in rows:
        table.add_row(*[fmt.format(r[k]) if r.get(k) is not None else "-" for k, _, fmt in columns])
    return table
