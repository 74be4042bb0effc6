"""What every experiment shares: the options of a run, the context (model, cached collection, progress
bars), the Outcome an experiment returns, how it is written (PNG, JSON, CSV; all atomic), and rollout time
two ways. Measured: wall seconds (on a shared machine, with other jobs' load). Modeled: the fitted latency
model (experiment 6) applied to every forward the rollout ran (rows x positions per row, padding included,
and the context read), plus the measured drafting time: what the same forwards cost here unloaded."""

from __future__ import annotations

import csv
import io
import shlex
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dasrl.atomic import MAX_JSON_BYTES, atomic_write, read_json, write_json
from dasrl.policy import LatencyModel
from dasrl_lab.experiments.machine import load_avg
from dasrl_lab.plots import pyplot, save_figure
from dasrl_lab.sim.sources import ChampSource
from dasrl_lab.sim.workloads import CPU_LATENCY

REAL = "real rollouts (SmolLM2-135M, this machine)"
REAL_FORWARDS = "real engine forwards (SmolLM2-135M, this machine)"
SIM = "simulator (synthetic workload, assumed 7B-on-GPU latency)"
MAX_FIT_ERROR = 0.15
"""Experiment 6's fit is used only when its mean relative error is at most this (a quiet machine)."""


@dataclass(frozen=True)
class RunOptions:
    """What `dasrl experiments` was asked to do."""

    out: Path
    """Folder for each experiment's figure and numbers, and the cached collection run."""
    quick: bool = False
    """Small sizes: the whole set in a few minutes."""
    model: str = "smollm2-135m"
    """Model of the real rollouts: the embedded default, a local HF folder, or a hub id (online only)."""
    command: str = "dasrl experiments"
    """The command line as given (recorded with every result)."""
    collect: tuple[tuple[str, int], ...] = ()
    """Overrides of the collection run's CollectConfig fields, as (name, value) pairs."""
    source: str | None = None
    """What the trace-replay experiments replay: 'champ', a path sources.load reads, or None (the collection)."""
    champ: ChampSource = ChampSource(model="GPT-4 Turbo", problems=60)
    """Which CHAMP solutions when source is 'champ' (GPT-4 Turbo: the most text of the four models)."""


@dataclass
class Outcome:
    """What one experiment measured."""

    summary: dict
    """Headline numbers (name -> value), shown in the summary table and in docs/results.md."""
    rows: list[dict]
    """The plotted numbers, one dict per row (written as CSV)."""
    figure: Callable[[Path], None]
    """Draws the figure into the given PNG path."""
    comparison: str
    """Markdown: how the result compares with the paper's, and why it differs where it does."""
    source: str = REAL
    """Where the numbers come from (REAL, SIM, or both)."""
    details: dict = field(default_factory=dict)
    """Everything else worth keeping (goes into the JSON)."""
    table: list[dict] = field(default_factory=list)
    """A few rows shown as a table in docs/results.md (default: none)."""


@dataclass(frozen=True)
class Experiment:
    """One reproduced measurement."""

    name: str
    """Command-line name (`dasrl experiments NAME`)."""
    title: str
    """One line: what it shows."""
    paper: str
    """The paper's figure it reproduces ("Fig. 1"; "beyond the paper")."""
    run: Callable[["Context"], Outcome]
    """Measures, returns the outcome."""


def figure(draw: Callable, *grid: int, **subplots) -> Callable[[Path], None]:
    """An Outcome's figure: draw(fig, axes) on fresh pyplot.subplots(*grid, **subplots), saved as PNG."""
    def write(path: Path) -> None:
        fig, axes = pyplot().subplots(*grid, **subplots)
        draw(fig, axes)
        save_figure(fig, path)
    return write


class Context:
    """One `dasrl experiments` invocation: options, console, and what experiments share, made once on
    first use: the model and the collection run (cached on disk under the out folder)."""

    def __init__(self, options: RunOptions, console: Console) -> None:
        self.options, self.console = options, console
        self._model = self._collection = self._responses = None

    def model(self):
        """(model, tokenizer), fp32, loaded on first use."""
        if self._model is None:
            import torch

            from dasrl_lab.models import load_model

            with self.console.status(f"loading {self.options.model}"):
                self._model = load_model(self.options.model, dtype=torch.float32)
        return self._model

    def collection(self):
        """The shared GRPO collection run (dasrl_lab.experiments.collect), from cache when there is one."""
        if self._collection is None:
            from dasrl_lab.experiments.collect import CollectConfig, ensure_collection

            o = self.options
            cfg = CollectConfig.quick(o.model) if o.quick else CollectConfig(model=o.model)
            self._collection = ensure_collection(replace(cfg, **dict(o.collect)), self)
        return self._collection

    def responses(self):
        """The recorded rollouts the trace-replay experiments (Figs. 4, 6, 7) replay: --source's, tokenized
        with the embedded SmolLM2's tokenizer, else the collection run's trace."""
        if self.options.source is None:
            return self.collection().trace().responses()
        if self._responses is None:
            from dasrl_lab.sim import sources

            tok = sources.hf_tokenizer(None)
            self._responses = sources.load(self.options.source, sources.tokenize_with(tok), champ=self.options.champ,
                                           vocab_size=len(tok))
        return self._responses

    def replayed(self) -> tuple[str, str]:
        """(what the trace-replay experiments replay, what one of its steps is) in words."""
        src, c = self.options.source, self.options.champ
        if src is None:
            return "the recorded SmolLM2 GRPO trace", "GRPO step"
        if src == "champ":
            return (f"CHAMP's recorded {c.model} solutions ({c.problems or 270} problems; a step is one of the 18 "
                    f"prompt variants, not a training step)", "step = CHAMP prompt variant")
        return f"the recorded rollouts of {src}", "step"

    @contextmanager
    def progress(self, description: str, total: int) -> Iterator[Callable[..., None]]:
        """A progress bar; yields advance(n=1, **fields)."""
        with Progress(TextColumn("{task.description:<34}"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("{task.fields[note]}"), TimeElapsedColumn(), console=self.console,
                      transient=True) as prog:
            task = prog.add_task(description, total=total, note="")
            yield lambda n=1, **fields: prog.update(task, advance=n, **fields)


def write_csv(path: Path, rows: list[dict]) -> None:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
    w.writeheader()
    w.writerows(rows)
    atomic_write(path, lambda f: f.write(buf.getvalue().encode()))


def run_experiment(exp: Experiment, ctx: Context) -> dict:
    """Run one experiment, write out/<name>/<name>.{png,json,csv}; returns the JSON document."""
    folder = ctx.options.out / exp.name
    folder.mkdir(parents=True, exist_ok=True)
    load0, t0 = load_avg(), time.perf_counter()
    outcome = exp.run(ctx)
    png = folder / f"{exp.name}.png"
    outcome.figure(png)
    o, col = ctx.options, ctx._collection
    c = col.config if col is not None else None
    doc = {"format": "dasrl-experiment/1", "name": exp.name, "title": exp.title, "paper": exp.paper,
           "source": outcome.source if o.source is None else f"replay of {ctx.replayed()[0]}, SmolLM2 tokenizer",
           "quick": o.quick, "command": o.command,
           "rerun": " ".join([f"dasrl experiments {exp.name} --out {o.out}"] + (["--quick"] if o.quick else [])
                             + [f"--{k.replace('_', '-')} {v}" for k, v in o.collect]
                             + ([] if o.source is None else [f"--source {shlex.quote(o.source)}"] + (
                                 [f"--champ-model {shlex.quote(o.champ.model)} --problems {o.champ.problems}"]
                                 if o.source == "champ" else []))),
           "collect": dict(o.collect),
           "collection": None if c is None else (
               f"GRPO collection run: {c.steps} steps x {c.prompts} prompts x {c.samples} samples, <= "
               f"{c.max_new_tokens} tokens, T={c.sampling().temperature}, engine variants on steps "
               f"{c.variant_steps} ({col.wall_s / 60:.1f} min)"),
           "summary": outcome.summary, "comparison": outcome.comparison, "table": outcome.table,
           "details": outcome.details, "figure": png.name, "seconds": round(time.perf_counter() - t0, 1),
           "load_before": load0, "load_after": load_avg(), "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
    write_json(folder / f"{exp.name}.json", doc)
    write_csv(folder / f"{exp.name}.csv", outcome.rows)
    return doc


def latency_model(ctx) -> tuple[LatencyModel, str]:
    """Experiment 6's fit (with the KV term) when it ran under this out folder and fits well; else the
    CPU figures measured on this project's machine unloaded (dasrl.policy.CPU_LATENCY)."""
    f = ctx.options.out / "latency" / "latency.json"
    if f.exists():
        d = read_json(f, MAX_JSON_BYTES, follow_symlinks=True)
        err = d["summary"]["kv_fit_rel_error"]
        if err <= MAX_FIT_ERROR:
            return LatencyModel.from_dict(d["details"]["with_kv"], source=str(f)), "fitted in experiment 6"
        note = f"experiment 6's fit missed by {err:.0%} on the loaded machine, so "
    else:
        note = "experiment 6 not run, so "
    c = CPU_LATENCY
    return c, (note + f"the CPU default (dasrl.policy.latency.CPU_LATENCY, one thread): {c.c_base * 1e3:.0f} ms + "
                      f"{c.c_tok * 1e3:.1f} ms/token + {c.c_other * 1e6:.0f} µs per row-context token + "
                      f"{c.c_draft_kv * 1e6:.0f} µs per drafting-row context token + {c.c_draft * 1e3:.1f} ms per "
                      f"forward with a drafting row")


def modeled_s(summary: dict, latency: LatencyModel) -> float:
    """Modeled seconds of one recorded rollout (see the module docstring)."""
    return sum(latency.price(shape) for shape in summary["shapes"]) + summary.get("draft_s", 0.0)


def modeled_curve(summary: dict, latency: LatencyModel) -> list[list[float]]:
    """[(modeled end time of forward k, live rows)]: the batch curve on the modeled clock."""
    t, out = 0.0, []
    for shape in summary["shapes"]:
        t += latency.price(shape)
        out.append([round(t, 4), shape[0]])
    return out
