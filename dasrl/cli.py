"""The `dasrl` command line: demo | bench | simulate | calibrate | trace | experiments.

Each concept package registers its own commands (a `register(app, bench)` function in its cli module),
so this file only assembles them.
"""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(help="dasrl: distribution-aware speculative decoding for RL rollouts.", no_args_is_help=True)
bench = typer.Typer(help="Benchmarks, side by side against baselines; each writes JSON with --json.",
                    no_args_is_help=True)
app.add_typer(bench, name="bench")

# Modules with a `register(app, bench)`; each adds its commands.
REGISTRARS = [
    "dasrl.drafter.cli",
    "dasrl.engine.cli",
    "dasrl.demo.cli",
    "dasrl.sim.cli",
    "dasrl.sim.gpu",
    "dasrl.sim.whatif_cli",
    "dasrl.integrations.vllm.cli",
    "dasrl.experiments.cli",
    "dasrl.integrations.cli",
]

for _name in REGISTRARS:
    importlib.import_module(_name).register(app, bench)


if __name__ == "__main__":
    app()
