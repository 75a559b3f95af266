"""One validation of the cost model's inputs, as the lab has one (`tplab.lab.arguments`).

Every public function of `tplab.cost` checks its arguments here before it computes anything,
so that a bad input gives a TypeError (wrong type) or ValueError (wrong value) whose message
names the argument, never a ZeroDivisionError, a `nan` or a negative time from deep inside.
"""

from __future__ import annotations

import math
import numbers


def _kind(value) -> str:
    return f"{type(value).__name__} {value!r}"


def check_int(name: str, value, minimum: int = 1) -> int:
    """A whole number >= `minimum` (bools refused: `True` is not a group of one)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {_kind(value)}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return int(value)


def check_number(name: str, value, minimum: float = 0.0, strict: bool = False,
                 maximum: float | None = None) -> float:
    """A finite real number >= `minimum` (> with `strict`), <= `maximum` if given."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {_kind(value)}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    if value < minimum or (strict and value == minimum):
        raise ValueError(f"{name} must be {'>' if strict else '>='} {minimum:g}, got {value:g}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum:g}, got {value:g}")
    return value


def check_choice(name: str, value, choices) -> str:
    """One of `choices` (strings)."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {tuple(choices)}, got {_kind(value)}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, not {value!r}")
    return value


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {_kind(value)}")
    return value


def check_type(name: str, value, types, what: str):
    """An instance of `types`, else a TypeError naming `what` it should be."""
    if not isinstance(value, types):
        raise TypeError(f"{name} must be {what}, got {_kind(value)}")
    return value


def check_sublayers(name: str, value, allowed=("attention", "mlp")) -> tuple[str, ...]:
    """A non-empty tuple of sublayer names (of `allowed`; None: any module names)."""
    if isinstance(value, str) or not isinstance(value, tuple | list):
        raise TypeError(f"{name} must be a tuple of {allowed}, got {_kind(value)}")
    bad = [v for v in value if not isinstance(v, str) or (allowed and v not in allowed)]
    if bad or not value:
        raise ValueError(f"{name} must be a non-empty tuple of {allowed}, got {value!r}")
    return tuple(value)


def check_rows(name: str, rows, keys) -> list[dict]:
    """Rows from `sweep`/`step_time`: a non-empty list of dicts with `keys`."""
    if isinstance(rows, dict) or not isinstance(rows, list | tuple):
        raise TypeError(f"{name} must be a list of rows from sweep or step_time, "
                        f"got {_kind(rows)}")
    if not rows:
        raise ValueError(f"{name} is empty: best_tp needs at least one row from sweep")
    for r in rows:
        if not isinstance(r, dict):
            raise TypeError(f"{name} must hold dicts (rows from sweep), got {_kind(r)}")
        missing = [k for k in keys if k not in r]
        if missing:
            raise ValueError(f"{name} rows need {missing} (rows from sweep or step_time)")
    return list(rows)


def check_degrees(name: str, value) -> tuple[int, ...]:
    """A non-empty sequence of parallel degrees (ints >= 1), never a bare int or a string."""
    if isinstance(value, str | bytes) or not hasattr(value, "__iter__"):
        raise TypeError(f"{name} must be a sequence of degrees such as (1, 2, 4), got "
                        f"{_kind(value)}; for one degree write ({value!r},)")
    out = tuple(value)
    if not out:
        raise ValueError(f"{name} must name at least one degree, got {value!r}")
    for v in out:
        check_int(f"{name} entry", v)
    return out


def check_choices(name: str, value, choices) -> tuple[str, ...]:
    """A non-empty sequence of `choices`, never a bare string (iterated letter by letter)."""
    if isinstance(value, str):
        raise TypeError(f"{name} must be a sequence of {tuple(choices)}, got the string "
                        f"{value!r}; for one write ({value!r},)")
    if not hasattr(value, "__iter__"):
        raise TypeError(f"{name} must be a sequence of {tuple(choices)}, got {_kind(value)}")
    out = tuple(value)
    if not out:
        raise ValueError(f"{name} must name at least one of {tuple(choices)}")
    for v in out:
        check_choice(f"{name} entry", v, choices)
    return out
