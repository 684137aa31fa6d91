"""One value checked against its key (type, pattern, choices and range), and the words an error
uses to describe a value or suggest a name."""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from control.bounded import clip
from control.schema import Key


class InvalidValue(Exception):
    """A value that does not fit its key; the message completes "<path>: "."""


def check_value(key: Key, value: Any) -> Any:
    """The value as the settings hold it; InvalidValue where it does not fit the key."""
    value = _CONVERT[key.kind](value)
    if key.pattern and not re.fullmatch(key.pattern, value):
        raise InvalidValue(f"must be {key.pattern_doc}, got {clip(repr(value))}")
    if value in key.retired:
        raise InvalidValue(f"{value!r} is no longer offered: {key.retired[value]}")
    if key.choices and value not in key.choices:
        listed = ", ".join(repr(c) for c in key.choices)
        raise InvalidValue(f"must be one of {listed}, got {clip(repr(value))}{suggest(value, key.choices)}")
    for number in value if isinstance(value, tuple) else (value,):
        if isinstance(number, int | float) and not isinstance(number, bool):
            _check_range(key, number)
    if key.kind == "mode":
        value = value.rjust(4, "0")
    return value


def _check_range(key: Key, number: float) -> None:
    too_low = key.lo is not None and (number <= key.lo if key.lo_open else number < key.lo)
    too_high = key.hi is not None and number > key.hi
    if not (too_low or too_high):
        return
    low = "" if key.lo is None else f"{'>' if key.lo_open else '>='} {_num(key.lo)}"
    high = "" if key.hi is None else f"<= {_num(key.hi)}"
    raise InvalidValue(f"must be {' and '.join(b for b in (low, high) if b)}, got {number}")


def _to_bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidValue(f"must be true or false, got {describe(value)}")
    return value


def _to_int(value: Any) -> int:
    # TOML booleans are not numbers, although Python's bool is an int.
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidValue(f"must be an integer, got {describe(value)}")
    return value


def _to_float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidValue(f"must be a number, got {describe(value)}")
    if not math.isfinite(value):
        raise InvalidValue(f"must be a finite number, got {value}")
    return float(value)


def _to_str(value: Any) -> str:
    if not isinstance(value, str):
        raise InvalidValue(f"must be a string, got {describe(value)}")
    if not value.strip():
        raise InvalidValue("must not be empty")
    return value


def _to_mode(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        raise InvalidValue(f'must be a string of octal digits such as "0600", got the integer {value}')
    return _to_str(value)


def _to_ks(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise InvalidValue(f"must be an array of integers, got {describe(value)}")
    if not value:
        raise InvalidValue("must not be empty")
    wrong = [v for v in value if isinstance(v, bool) or not isinstance(v, int)]
    if wrong:
        raise InvalidValue(f"must hold integers only, got {describe(wrong[0])}")
    repeated = sorted({v for v in value if value.count(v) > 1})
    if repeated:
        raise InvalidValue(f"has duplicates: {', '.join(map(str, repeated))}")
    return tuple(value)


_CONVERT: Mapping[str, Callable[[Any], Any]] = {
    "bool": _to_bool,
    "int": _to_int,
    "float": _to_float,
    "str": _to_str,
    "path": _to_str,  # resolved against the config directory once the base is known
    "mode": _to_mode,
    "ks": _to_ks,
}


def suggest(word: str, known: Sequence[str] | Mapping[str, Any]) -> str:
    if len(word) > 64:
        return ""  # no key or choice is that long, and matching one would take a while
    close = difflib.get_close_matches(word, list(known), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def describe(value: Any) -> str:
    """A value as TOML would name it: "string 'x'", "boolean true", "table"."""
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, int):
        return f"integer {value}"
    if isinstance(value, float):
        return f"float {value}"
    if isinstance(value, str):
        return f"string {clip(repr(value))}"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    return f"{type(value).__name__} {value}"  # dates and times


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)
