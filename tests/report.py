"""Lines that test modules want printed at the end of the run (see conftest.py), by topic:
a module set up twice (session fixtures with params) overwrites its earlier lines.

`TIMES` holds timings by topic: (header, {name: seconds}). Under pytest-xdist each worker
sends its own back to the controller (conftest.py), where a topic's times from every worker
are printed together, with their total."""

LINES: dict[str, list[str]] = {}
TIMES: dict[str, tuple[str, dict[str, float]]] = {}


def lines() -> list[str]:
    """Every topic's lines, then every topic's times (sorted by name) and their total."""
    out = [line for topic in LINES.values() for line in topic]
    for header, times in TIMES.values():
        out += [header, *(f"  {name}: {s:.1f} s" for name, s in sorted(times.items())),
                f"  total: {sum(times.values()):.1f} s"]
    return out


def merge(lines_: dict[str, list[str]], times: dict[str, list]) -> None:
    """Add what one xdist worker reported (its LINES and TIMES, as sent) to this process's."""
    LINES.update(lines_)
    for topic, (header, named) in times.items():
        TIMES.setdefault(topic, (header, {}))[1].update(named)
