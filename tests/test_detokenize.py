"""Decoding only the newest tokens gives what decoding the whole output would, at every step."""

from __future__ import annotations

import random

from tokenizers import Tokenizer

from engine.detokenize import INCOMPLETE, IncrementalDecoder, OutputText
from tests.conftest import DEFAULT_TARGET

TEXT = "naïve café: 世界, déjà vu 🙂🚀. def f(x):\n    return x  # END of story ✓\n"


def chunks(tokens: list[int], rng: random.Random) -> list[list[int]]:
    out, at = [], 0
    while at < len(tokens):
        size = rng.choice([1, 1, 2, 3, 7])  # as rounds emit them: one token, or a run of kept drafts
        out.append(tokens[at : at + size])
        at += size
    return out


def test_incremental_text_equals_the_whole_decode_at_every_step():
    tokenizer = Tokenizer.from_file(str(DEFAULT_TARGET / "tokenizer.json"))
    rng = random.Random(0)
    encoded = tokenizer.encode(TEXT).ids
    noise = [rng.randrange(tokenizer.get_vocab_size()) for _ in range(300)]  # any ids, split characters included
    for tokens in (encoded, noise, encoded + noise + encoded):
        decoder, seen = IncrementalDecoder(tokenizer), []
        pieces = chunks(tokens, rng)
        for i, piece in enumerate(pieces):
            decoder.push(piece, final=i == len(pieces) - 1)
            seen.extend(piece)
            whole = tokenizer.decode(seen)
            # Only a partial character at the end may wait, until the last push.
            assert whole.startswith(decoder.text) and INCOMPLETE not in whole[len(decoder.text) :].strip(INCOMPLETE)
        assert decoder.text == tokenizer.decode(tokens)


def test_output_text_ends_where_the_first_stop_string_starts():
    tokenizer = Tokenizer.from_file(str(DEFAULT_TARGET / "tokenizer.json"))
    tokens = tokenizer.encode(TEXT).ids
    full = tokenizer.decode(tokens)
    for stop in (("END",), ("ZZZ", "vu 🙂"), ("return x", "f("), ("never",)):
        output = OutputText(tokenizer, stop)
        stopped_at = None
        for i, token in enumerate(tokens):
            output.push([token])
            if output.stopped and stopped_at is None:
                stopped_at = i
        cut = min([full.find(s) for s in stop if s in full], default=None)
        assert output.text == (full if cut is None else full[:cut])
        if cut is not None:  # the stop is found at the token that completes it, not later
            assert stop_in(tokenizer.decode(tokens[: stopped_at + 1]), stop)
            assert not stop_in(tokenizer.decode(tokens[:stopped_at]), stop)


def stop_in(text: str, stop: tuple[str, ...]) -> bool:
    return any(s in text for s in stop)
