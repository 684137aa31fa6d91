"""argparse types shared by the command-line tools (benches, training scripts): a value out of
range is a usage error naming it, before anything is loaded or run."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def at_least(low: int) -> Callable[[str], int]:
    """An integer no less than `low`."""

    def integer(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, not {value}")
        return value

    return integer


def above_zero(text: str) -> float:
    """A number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be above 0, not {text}")
    return value


def integers(low: int, high: int | None = None) -> Callable[[str], list[int]]:
    """A comma-separated list of integers, each in low..high."""
    each = at_least(low)

    def parse(text: str) -> list[int]:
        values = [each(part.strip()) for part in text.split(",") if part.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"{text!r} names no integer")
        if high is not None and (over := [v for v in values if v > high]):
            raise argparse.ArgumentTypeError(f"{over[0]} is above {high}")
        return values

    return parse
