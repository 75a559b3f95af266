"""Lines that test modules want printed at the end of the run (see conftest.py), by topic:
a module set up twice (session fixtures with params) overwrites its earlier lines."""

LINES: dict[str, list[str]] = {}
