"""The `dasrl` command line: demo | bench | simulate | calibrate | trace | experiments, assembled from the
command modules' `register(app, bench)` functions.
"""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(help="dasrl: distribution-aware speculative decoding for RL rollouts.", no_args_is_help=True)
bench = typer.Typer(help="Benchmarks, side by side against baselines; each writes JSON with --json.",
                    no_args_is_help=True)
app.add_typer(bench, name="bench")

# This order is the order of --help.
REGISTRARS = [
    "dasrl_lab.bench.drafter_cli",
    "dasrl_lab.bench.engine_cli",
    "dasrl_lab.demo.cli",
    "dasrl_lab.sim.cli",
    "dasrl_lab.bench.gpu",
    "dasrl_lab.sim.whatif_cli",
    "dasrl_lab.bench.vllm_cli",
    "dasrl_lab.experiments.cli",
    "dasrl_lab.bench.ray_cli",
    "dasrl_lab.bench.proposer",
]

for _name in REGISTRARS:
    importlib.import_module(_name).register(app, bench)


if __name__ == "__main__":
    app()
