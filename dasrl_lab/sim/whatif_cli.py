"""`dasrl whatif SOURCE`: replay recorded rollouts through every drafter and predict rollout time per step
on latency profiles (see dasrl_lab/sim/whatif.py and docs/whatif.md)."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import List, Optional

import typer
from rich import box
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from dasrl_lab.cli_args import between, json_option, output_file, write_json_out

console = Console()


def _profiles(latency: list[str], shipped: bool):
    from dasrl.policy import LatencyModel
    from dasrl_lab.sim import profiles

    out = profiles.shipped() if shipped else []
    for spec in latency:
        name, _, path = spec.rpartition("=")
        path = Path(path)
        try:
            lat = LatencyModel.load(path)
        except (OSError, ValueError) as e:
            raise typer.BadParameter(str(e), param_hint="'--latency'") from None
        out.append(profiles.measured(name or path.stem, lat, str(path)))
    return out  # none (--no-shipped, no --latency): the hardware-independent figures only


def table(doc: dict) -> Table:
    """Per (model, method): the hardware-independent figures and the predicted time vs plain decoding
    on each profile (from step 2); fits 80 columns for up to three profiles."""
    profs = [p["name"] for p in doc["profiles"]]
    t = Table(box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, collapse_padding=True,
              title=f"whatif {doc['source']}: K = {doc['cap']}")
    for c in ("model", "method", "tok/fwd", "crit", "acc%") + (("host s",) if profs else ()):
        t.add_column(c, justify="right" if c not in ("model", "method") else "left", no_wrap=True)
    for i, _ in enumerate(profs):
        t.add_column(f"P{i + 1} x", justify="right", no_wrap=True)
    none = {(r["model"]): r["predicted_s_per_step"] for r in doc["rows"] if r["drafter"] == "none"}
    for r in doc["rows"]:
        base = none.get(r["model"])
        cells = [f"{r['predicted_s_per_step'][p] / base[p]:.2f}" if base and base[p] else
                 f"{r['predicted_s_per_step'][p]:.1f}s" for p in profs]
        t.add_row(r["model"][:10], r["drafter"], f"{r['tokens_per_forward']:.2f}",
                  f"{r['critical_tokens_per_forward']:.2f}", f"{100 * r['acceptance']:.0f}",
                  *([f"{r['host_s_per_step'][profs[0]]:.2f}"] if profs else []), *cells)
    t.caption = "  ".join(f"P{i + 1}={p}" for i, p in enumerate(profs)) + \
        "  (x: predicted s/step from step 2 / plain decoding's, forwards only; host s: this CPU's seconds per " \
        "step proposing and observing, under P1)"
    return t


def plot(doc: dict, path: Path) -> None:
    """Predicted rollout seconds per step by method: one panel per (model, profile)."""
    from dasrl_lab.plots import pyplot, save_figure

    plt = pyplot()
    models = list(dict.fromkeys(r["model"] for r in doc["rows"]))
    profs = [p["name"] for p in doc["profiles"]]
    fig, axes = plt.subplots(len(models), len(profs), figsize=(3.6 * len(profs), 2.8 * len(models)), squeeze=False)
    for i, m in enumerate(models):
        for j, p in enumerate(profs):
            ax = axes[i][j]
            for r in (r for r in doc["rows"] if r["model"] == m):
                ax.plot([s["step"] for s in r["steps"]], [s["predicted_s"][p] for s in r["steps"]], marker=".",
                        label=r["drafter"])
            ax.set_title(f"{m} on {p}", fontsize=8)
            ax.set_xlabel("step", fontsize=7)
            ax.set_ylabel("predicted s / step", fontsize=7)
            ax.tick_params(labelsize=7)
            ax.set_ylim(bottom=0)
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    save_figure(fig, path, dpi=110, tight=False)


def register(app: typer.Typer, bench: typer.Typer) -> None:
    @app.command("whatif")
    def whatif_cmd(
        source: str = typer.Argument(..., help="'champ', a VeRL rollout_data_dir, a .jsonl / .parquet file "
                                               "(step, problem_id or prompt, response), or a dasrl trace."),
        tokenizer: Optional[Path] = typer.Option(None, help="Local HF tokenizer folder (default: the embedded "
                                                            "SmolLM2's)."),
        champ_model: List[str] = typer.Option(["GPT-4"], "--champ-model",
                                              help="CHAMP model(s), each its own run; 'all' = the four."),
        variants: Optional[str] = typer.Option(None, help="CHAMP: comma-separated variants playing the steps "
                                                          "(default: all 18)."),
        samples: int = typer.Option(1, callback=between(1, 18), help="CHAMP: variants per problem in one step."),
        problems: int = typer.Option(60, callback=between(0, 270), help="CHAMP: the first N problems (0 = all 270; "
                                     "the default 60 keeps `dasrl whatif champ` within ~5 min on one CPU core)."),
        copies: bool = typer.Option(False, "--champ-copies/--no-champ-copies",
                                    help="CHAMP: keep solutions that repeat an earlier variant's verbatim."),
        cap: int = typer.Option(16, "--cap", "-k", callback=between(1, 256), help="The equal draft cap K."),
        branching: int = typer.Option(1, callback=between(1, 64), help="das drafters: children kept per draft "
                                      "node (1 = chains; > 1 = trees, verified by the engine's accept rule)."),
        methods: str = typer.Option(",".join(("das", "das-suffix", "global", "suffix", "ngram", "oracle", "none")),
                                    help="Comma-separated methods."),
        latency: List[str] = typer.Option([], help="[NAME=]latency.json from `dasrl calibrate` / "
                                                   "`dasrl bench gpu` (repeatable)."),
        shipped: bool = typer.Option(True, help="Include the shipped (assumed) GPU profiles (--no-shipped "
                                                "without --latency: tokens per forward only, no time)."),
        jobs: int = typer.Option(0, callback=between(0, 256), help="Worker processes replaying in parallel "
                                                                  "(0 = the cores this process may use)."),
        json_out: Optional[Path] = json_option("Write JSON here."),
        png: Optional[Path] = typer.Option(None, callback=output_file, help="Write the per-step time plot here."),
    ) -> None:
        """What would speculative decoding, and which drafter, do to these recorded rollouts?"""
        from dasrl_lab import champ
        from dasrl_lab.sim import sources, whatif

        started = time.perf_counter()
        try:
            store = replace(whatif.WhatifConfig().store,
                            params=replace(whatif.WhatifConfig().store.params, branching=branching))
            cfg = whatif.WhatifConfig(cap=cap, methods=tuple(m.strip() for m in methods.split(",") if m.strip()),
                                      store=store)
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
        profs = _profiles(latency, shipped)
        if png is not None and not profs:
            raise typer.BadParameter("--png plots predicted time: give --latency FILE or leave --no-shipped out")
        models = list(champ.MODELS) if champ_model == ["all"] else champ_model
        if source != "champ" and champ_model != ["GPT-4"]:
            raise typer.BadParameter("--champ-model applies to the 'champ' source only")
        vs = tuple(v.strip() for v in variants.split(",")) if variants else ()
        loaded = []
        try:  # every source is read and checked before anything is replayed or written
            tok = sources.hf_tokenizer(tokenizer)
            tokenize = sources.tokenize_with(tok)
            for m in (models if source == "champ" else [Path(source).name]):
                spec = sources.ChampSource(model=m, variants=vs, samples=samples, problems=problems, copies=copies)
                loaded.append((m, sources.load(source, tokenize, champ=spec, vocab_size=len(tok))))
        except sources.SourceError as e:
            console.print(f"[red]error:[/red] {e}", soft_wrap=True)
            raise typer.Exit(2) from None
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TimeElapsedColumn(), console=console, transient=True) as bar:
            tasks = {name: bar.add_task(name, total=None) for name, _ in loaded}

            def tick(name, label, done, total):
                bar.update(tasks[name], description=f"{name[:14]} {label}", completed=done, total=total)

            try:
                results = whatif.run_all(loaded, profiles=profs, cfg=cfg, tokenizer=tok, progress=tick,
                                         jobs=jobs or whatif.default_jobs())
            except RuntimeError as e:
                console.print(f"[red]error:[/red] {e}", soft_wrap=True)
                raise typer.Exit(2) from None
        champ_doc = {"champ": {"variants": list(vs) or "all 18", "samples": samples, "problems": problems or 270,
                               "copies": copies}} if source == "champ" else {}
        doc = whatif.document(results, profiles=profs, cfg=cfg, source=source, started=started,
                              tokenizer_name=str(tokenizer or "smollm2-135m (embedded)"),
                              extra={"jobs": jobs or whatif.default_jobs(), **champ_doc})
        console.print(table(doc))
        write_json_out(json_out, doc, console)
        if png is not None:
            plot(doc, png)
            console.print(f"wrote {png}")
        console.print(f"{doc['elapsed_s']:.0f} s")
