"""Echoing what a user sent, bounded: an error or a log line quotes at most a short prefix."""

from __future__ import annotations

LIMIT = 80


def clip(text: str, limit: int = LIMIT) -> str:
    """`text`, or its first `limit` characters and how long it was."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"
