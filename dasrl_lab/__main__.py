"""The `dasrl` command (and `python -m dasrl_lab`): the lab's typer app, or one line saying how to get it.

`pip install dasrl` installs this command without the lab's dependencies (typer, rich, matplotlib, the
engine, ...). Then the command prints which module is missing and the extra to install, and exits 2, rather
than crashing with a traceback. The app itself is dasrl_lab.cli:app.
"""

from __future__ import annotations

import sys

HINT = "the dasrl command is the lab: pip install 'dasrl[lab]'"


def main() -> None:
    try:
        from dasrl_lab.cli import app
    except ImportError as e:  # ModuleNotFoundError, or dasrl's _MissingExtra (an ImportError naming the module)
        missing = e.name or ""
        if not missing or missing.split(".")[0] in ("dasrl", "dasrl_lab"):
            raise  # our own module is broken: not a missing dependency
        print(f"{HINT} (missing: {missing})", file=sys.stderr)
        raise SystemExit(2) from None
    app()


if __name__ == "__main__":
    main()
