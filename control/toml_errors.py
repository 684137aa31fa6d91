"""TOML syntax errors in a user's words: the common mistakes (an unclosed header, a string
without its closing quote, a key set twice, a table declared twice, a value without a key, a key
without a value, an unquoted word), told apart by reading the line tomllib stopped at, whose own
words can point elsewhere (an unclosed header reads "Cannot declare ... twice")."""

from __future__ import annotations

import re
import sys
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

_BARE_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
_NOT_BARE = {"true", "false", "inf", "nan"}


def explain(lines: list[str], line: int, at_end: bool = False) -> str | None:
    """Plain words, with line and column, for the mistake on `line` (at the end of the document:
    on the last line that holds something); None where it is none of the common ones."""
    while at_end and line > 1 and (line > len(lines) or not _split_comment(lines[line - 1])[0].strip()):
        line -= 1  # "at end of document": the mistake is on the last line that holds something
    if not 0 < line <= len(lines):
        return None
    source = lines[line - 1]
    code, open_quote = _split_comment(source)
    stripped = code.strip()
    start = len(code) - len(code.lstrip()) + 1  # column of the line's first character
    where = f"line {line}, column {start}: "
    if stripped.startswith("[") and open_quote is None:
        return _explain_header(lines, line, stripped, where)
    if open_quote is not None:
        quote = source[open_quote]
        return f"line {line}, column {open_quote + 1}: the string opened here is not closed: add the closing {quote}"
    key, equals, value = stripped.partition("=")
    if not equals:
        return None
    key, value = key.strip(), value.strip()
    if not key:
        return f'{where}"{_shorten(stripped)}" is a value without a key: write the key\'s name before "="'
    if not value:
        column = len(code.rstrip()) + 1
        return f'line {line}, column {column}: "{key}" has no value: write one after "="'
    if _BARE_WORD.fullmatch(value) and value not in _NOT_BARE:
        column = code.index(value, code.index("=")) + 1
        return f'line {line}, column {column}: the text {value} needs quotes: write {key} = "{value}"'
    return _explain_duplicate_key(lines, line, key, where)


def _explain_header(lines: list[str], line: int, header: str, where: str) -> str | None:
    double = header.startswith("[[")
    close = "]]" if double else "]"
    if (double and not header.endswith("]]")) or (not double and "]" not in header):
        fixed = header.rstrip("]").rstrip() + close
        return f'{where}the table header "{_shorten(header)}" is not closed: write "{_shorten(fixed)}"'
    if double or not header.endswith("]"):
        return None
    parts = _key_parts(header[1:-1])
    before = _parse_prefix(lines, line)
    if parts is None or before is None or not isinstance(_lookup(before, parts), dict):
        return None
    first = next((i + 1 for i in range(line - 1) if _header_parts(lines[i]) == parts), None)
    since = f" (first at line {first})" if first else ""
    return f"{where}the table {_shorten(header)} is declared twice{since}"


def _explain_duplicate_key(lines: list[str], line: int, key: str, where: str) -> str | None:
    parts = _key_parts(key)
    before = _parse_prefix(lines, line)
    if parts is None or before is None:
        return None
    header_line = next((i for i in range(line - 2, -1, -1) if _header_parts(lines[i]) is not None), None)
    table: list[str] = [] if header_line is None else _header_parts(lines[header_line]) or []
    if _lookup(before, [*table, *parts]) is None:
        return None
    first = next(
        (i + 1 for i in range((header_line or -1) + 1, line - 1) if _line_key(lines[i]) == parts),
        None,
    )
    since = f" (first at line {first})" if first else ""
    inside = f" in {_split_comment(lines[header_line])[0].strip()}" if header_line is not None else ""
    return f'{where}"{_shorten(key)}" is set twice{inside}{since}'


def _split_comment(text: str) -> tuple[str, int | None]:
    """The line without its comment, and the index of a quote it opens and does not close."""
    if '"""' in text or "'''" in text:
        return text, None  # multi-line strings: not judged here
    i = 0
    while i < len(text):
        char = text[i]
        if char == "#":
            return text[:i], None
        if char in "\"'":
            end = i + 1
            while end < len(text) and text[end] != char:
                end += 2 if char == '"' and text[end] == "\\" else 1
            if end >= len(text):
                return text, i
            i = end
        i += 1
    return text, None


def _key_parts(key: str) -> list[str] | None:
    """The names a (dotted, maybe quoted) key is made of, as TOML reads them."""
    try:
        document: Any = tomllib.loads(f"{key} = 0")
    except tomllib.TOMLDecodeError:
        return None
    parts = []
    while isinstance(document, dict) and len(document) == 1:
        ((name, document),) = document.items()
        parts.append(name)
    return parts


def _header_parts(text: str) -> list[str] | None:
    code = _split_comment(text)[0].strip()
    if code.startswith("[[") and code.endswith("]]"):
        return _key_parts(code[2:-2])
    if code.startswith("[") and code.endswith("]"):
        return _key_parts(code[1:-1])
    return None


def _line_key(text: str) -> list[str] | None:
    code = _split_comment(text)[0]
    key, equals, _ = code.partition("=")
    return _key_parts(key.strip()) if equals and key.strip() else None


def _parse_prefix(lines: list[str], line: int) -> dict[str, Any] | None:
    """The document up to (not including) `line`, where that much of it is valid TOML."""
    try:
        return tomllib.loads("\n".join(lines[: line - 1]))
    except tomllib.TOMLDecodeError:
        return None


def _lookup(document: Any, parts: list[str]) -> Any:
    for name in parts:
        if isinstance(document, list) and document:
            document = document[-1]  # [[array.of.tables]]: its last table is the one being filled
        if not isinstance(document, dict) or name not in document:
            return None
        document = document[name]
    return document


def _shorten(text: str) -> str:
    return text if len(text) <= 60 else text[:57] + "..."
