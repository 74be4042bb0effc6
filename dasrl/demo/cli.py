"""`dasrl demo`: GRPO on the embedded model with baseline and DAS rollouts side by side."""

from __future__ import annotations

import dataclasses

import typer

from dasrl.demo.run import DemoConfig, run_demo

_D = DemoConfig()


def register(app: typer.Typer, bench: typer.Typer) -> None:
    @app.command("demo")
    def demo(
        steps: int = typer.Option(_D.steps, help="GRPO steps (every prompt comes back each step)."),
        prompts: int = typer.Option(_D.prompts, help="Distinct problems."),
        samples: int = typer.Option(_D.samples, help="Samples per problem (GRPO group size)."),
        max_new_tokens: int = typer.Option(_D.max_new_tokens, help="Generation limit per sample."),
        model: str = typer.Option(_D.model, help="Model: the embedded default, a local HF folder, or a hub id."),
        temperature: float = typer.Option(_D.temperature, help="Sampling temperature."),
        policy: str = typer.Option(_D.policy, help="Budget policy of the DAS session."),
        seed: int = typer.Option(_D.seed, help="Run seed."),
        out: str = typer.Option(_D.out, help="Folder for the report (a timestamped subfolder)."),
    ) -> None:
        """GRPO on SmolLM2: baseline and DAS rollouts, same seeds, identical outputs, side by side."""
        cfg = dataclasses.replace(_D, steps=steps, prompts=prompts, samples=samples, max_new_tokens=max_new_tokens,
                                  model=model, temperature=temperature, policy=policy, seed=seed, out=out)
        try:
            run_demo(cfg)
        except (ValueError, FileNotFoundError, RuntimeError) as e:
            typer.secho(f"error: {e}", fg="red", err=True)
            raise typer.Exit(2) from None
