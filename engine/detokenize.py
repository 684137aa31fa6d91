"""Text from a growing list of tokens, decoding only the newest few each time.

Decoding the whole output at every step costs its length again each round. A character may span
several byte-level tokens, and some decoders drop or merge a space at the start of what they
decode, so new tokens are decoded together with the few before them (from `prefix`), and only
what they add to that context's text is appended, once it no longer ends in part of a character.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

# What a decoder makes of bytes that do not (yet) form a whole UTF-8 character.
INCOMPLETE = "\ufffd"


class IncrementalDecoder:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.tokens: list[int] = []
        self.text = ""  # everything decoded so far; a trailing partial character waits
        self._prefix = 0  # tokens[prefix:read] were decoded last time, as context
        self._read = 0  # tokens[read:] are not in `text` yet

    def push(self, tokens: Sequence[int], final: bool = False) -> str:
        """Add tokens; return the text they completed (with `final`, whatever is left, partial
        characters as U+FFFD, as a whole decode gives them)."""
        self.tokens.extend(tokens)
        if len(self.tokens) == self._read:
            return ""
        context = self._tokenizer.decode(self.tokens[self._prefix : self._read])
        window = self._tokenizer.decode(self.tokens[self._prefix :])
        if not final and (len(window) <= len(context) or window.endswith(INCOMPLETE)):
            return ""
        added = window[len(context) :]
        self._prefix, self._read = self._read, len(self.tokens)
        self.text += added
        return added


class OutputText:
    """A sequence's output as text, as it grows, ending where the first stop string starts (the
    stop string itself is not part of it, as in OpenAI's API). Only the text new tokens added, and
    the longest stop string's length before it, is searched each time."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self.decoder = IncrementalDecoder(tokenizer)
        self.stop = tuple(stop)
        self._longest = max((len(s) for s in self.stop), default=0)
        self._searched = 0
        self.cut: int | None = None  # where a stop string starts, once one has appeared

    def push(self, tokens: Sequence[int], final: bool = False) -> None:
        self.decoder.push(tokens, final)
        if self.cut is not None or not self.stop:
            return
        text = self.decoder.text
        start = max(0, self._searched - self._longest + 1)
        self._searched = len(text)
        found = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        if found:
            self.cut = min(found)

    @property
    def stopped(self) -> bool:
        return self.cut is not None

    @property
    def text(self) -> str:
        return self.decoder.text if self.cut is None else self.decoder.text[: self.cut]
