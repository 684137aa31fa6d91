"""From the engine's tokens to the text a client sees, as it grows.

Only new tokens are decoded each step (engine/detokenize.py). Stop strings follow OpenAI's
semantics: the text ends just before the first stop string and does not include it. The engine
stops at the token that completes a stop string, so the text is trimmed here; while streaming, a
tail that might still grow into a stop string is held back until it either does (and is dropped)
or cannot.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

from engine.detokenize import INCOMPLETE, OutputText


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self._output = OutputText(tokenizer, stop)
        self._stop = tuple(stop)
        self._sent = 0  # characters of `text` already handed out
        self.text = ""  # the output so far, trimmed at a stop string

    def push(self, tokens: Sequence[int], final: bool = False) -> str:
        """Add a step's tokens; return the text that may be sent now (everything when `final`)."""
        self._output.push(tokens, final)
        text = self._output.text
        final = final or self._output.stopped
        self.text = text
        end = len(text) if final else self._settled(text)
        piece = text[self._sent : end]
        self._sent = max(self._sent, end)
        return piece

    def _settled(self, text: str) -> int:
        """How much of `text` can no longer change: not an incomplete character, not a stop's prefix."""
        end = len(text.rstrip(INCOMPLETE))
        held = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, end), held, -1):
                if text.endswith(stop[:size], 0, end):
                    held = size
                    break
        return end - held
