"""The `dasrl` command (and `python -m dasrl_lab`): the lab's typer app, dasrl_lab.cli:app, or, where `pip install
dasrl` left out the lab's dependencies, one line naming the missing module and the extra (exit 2).
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
