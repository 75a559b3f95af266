"""`python -m tplab COMMAND`: command-line tools.

    python -m tplab check PKG.MOD:build PKG.MOD:plan PKG.MOD:make_input --world-size 4
    python -m tplab doctor [--json]      is this machine ready for a workshop?
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {"check": "tplab.checks.cli", "doctor": "tplab.checks.doctor"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m tplab {{{','.join(COMMANDS)}}} [options]", file=sys.stderr)
        return 2
    return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
