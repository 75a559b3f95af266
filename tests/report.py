"""Lines that test modules want printed at the end of the run (see conftest.py)."""

LINES: list[str] = []
