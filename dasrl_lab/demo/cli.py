"""`dasrl demo`: GRPO on the embedded model with baseline and DAS rollouts side by side."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from dasrl_lab.cli_args import MAX_COUNT, MAX_STEPS, between, model_option, output_folder
from dasrl_lab.demo.run import DemoConfig, run_demo

_D = DemoConfig()


def register(app: typer.Typer, bench: typer.Typer) -> None:
    @app.command("demo")
    def demo(
        preset: str = typer.Option(_D.preset, help="math (CHAMP, T=0.6) | enumerations (toy long tail) | short."),
        steps: int = typer.Option(_D.steps, help="GRPO steps (every prompt comes back each step).",
                                  callback=between(1, MAX_STEPS)),
        prompts: Optional[int] = typer.Option(None, help="Distinct problems (default: the preset's).",
                                              callback=between(1, MAX_COUNT)),
        samples: Optional[int] = typer.Option(None, callback=between(1, MAX_COUNT),
                                              help="Samples per problem (GRPO group size) (default: the preset's)."),
        max_new_tokens: Optional[int] = typer.Option(None, help="Generation limit per sample (default: the preset's).",
                                                     callback=between(1, MAX_COUNT)),
        model: str = model_option(default=_D.model),
        temperature: Optional[float] = typer.Option(None, help="Sampling temperature (default: the preset's)."),
        policy: str = typer.Option(_D.policy, help="Budget policy of the DAS session."),
        counting: bool = typer.Option(_D.counting, help="Counting drafts (numbered patterns) in the DAS session."),
        seed: int = typer.Option(_D.seed, help="Run seed."),
        out: str = typer.Option(_D.out, help="Folder for the report (a timestamped subfolder).",
                                callback=output_folder),
    ) -> None:
        """GRPO on SmolLM2: baseline and DAS rollouts, same seeds, identical outputs, side by side."""
        try:
            cfg = DemoConfig.for_preset(preset, steps=steps, prompts=prompts, samples=samples,
                                        max_new_tokens=max_new_tokens, model=model, temperature=temperature,
                                        policy=policy, counting=counting, seed=seed, out=out)
            cfg.validate()  # no model loaded, no run folder made, for a bad flag
            if Path(out).exists() and not Path(out).is_dir():
                raise ValueError(f"--out {out!r} is a file; it must be a folder (or not exist yet)")
        except ValueError as e:
            typer.secho(f"error: {e}", fg="red", err=True)
            raise typer.Exit(2) from None
        try:
            run_demo(cfg)
        except (ValueError, OSError, RuntimeError) as e:  # OSError: the run folder cannot be made
            typer.secho(f"error: {e}", fg="red", err=True)
            raise typer.Exit(2) from None
