"""`python -m tplab COMMAND ...`: the commands for a user's own CI.

    python -m tplab check PKG.MOD:build PKG.MOD:plan PKG.MOD:make_input --world-size 4
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"check": "tplab.cli_check"}
    if not argv or argv[0] not in commands:
        print(f"usage: python -m tplab {{{','.join(commands)}}} ...", file=sys.stderr)
        return 2
    import importlib

    return importlib.import_module(commands[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
