"""Chat messages to a prompt: the checkpoint's own chat template, or a plain fallback.

The template is the Jinja2 text in the checkpoint's `chat_template.jinja`, or else in its
`tokenizer_config.json` ("chat_template", a string or a list of named templates, of which
"default" is used), or a GGUF file's `tokenizer.chat_template`; rendered as transformers'
`apply_chat_template` does: in a sandbox, with `messages`, `add_generation_prompt=True`, the
special tokens (`bos_token`, `eos_token`, `pad_token`, ...), `tools` and `documents` set to none
(templates test them with `is not none`, and an undefined one is not none), transformers'
`tojson`, `raise_exception` and `strftime_now`, and its `{% generation %}` tag. Templates put the
special tokens in themselves, so their text is tokenized without adding any.

A checkpoint with no template (such as a base model) gets the plain fallback: one
"role: content" line per message, then "assistant: " for the model to continue. It is tokenized
like a completion prompt.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The special tokens tokenizer_config.json may name, each given to the template by that name.
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")

Message = Mapping[str, str]  # {"role": ..., "content": ...}, and "name" where the client gave one


class ChatTemplateError(ValueError):
    """The template refused the messages (a `raise_exception` in it) or failed to render."""


class ChatTemplate:
    def __init__(self, source: str | None = None, special_tokens: Mapping[str, str] | None = None) -> None:
        """`source` is the Jinja2 text, or None for the plain fallback; `special_tokens`: the text
        of each one templates may name (`bos_token`, `eos_token`, `pad_token`, ...), "" where the
        checkpoint has none."""
        self.source = source
        self.special_tokens = {name: "" for name in _SPECIAL_TOKENS} | dict(special_tokens or {})
        try:
            self._template = _environment().from_string(source) if source is not None else None
        except TemplateError as err:
            raise ChatTemplateError(f"the chat template does not compile: {err}") from None

    @classmethod
    def from_checkpoint(cls, path: Path) -> ChatTemplate:
        """The checkpoint's template: `chat_template.jinja` where there is one (as transformers
        prefers it), else tokenizer_config.json's "chat_template" (of a list, the one named
        "default", else the first). Of a GGUF file, its `tokenizer.chat_template` (CheckpointError
        where the file cannot be read)."""
        if path.is_file():
            from engine.gguf import GGUFCheckpoint  # numpy and the gguf package, only for a GGUF

            return cls(*GGUFCheckpoint(path).chat_template())
        config = _read_json(path / "tokenizer_config.json")
        source = config.get("chat_template")
        if isinstance(source, list):  # [{"name": ..., "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default", next(iter(named.values()), None))
        jinja_file = path / "chat_template.jinja"
        if jinja_file.exists():
            source = jinja_file.read_text()
        return cls(source or None, {name: _token_text(config.get(name)) for name in _SPECIAL_TOKENS})

    @property
    def adds_special_tokens(self) -> bool:
        """Whether the rendered text already holds the special tokens (so tokenizing adds none)."""
        return self.source is not None

    def render(self, messages: Sequence[Message]) -> str:
        if self._template is None:
            return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
        try:
            return self._template.render(
                messages=list(messages),
                add_generation_prompt=True,
                tools=None,
                documents=None,
                **self.special_tokens,
            )
        except TemplateError as err:
            raise ChatTemplateError(f"the chat template rejected the messages: {err}") from None
        except Exception as err:  # the template's own arithmetic or indexing on these messages
            raise ChatTemplateError(f"the chat template failed on the messages: {err!r}") from None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str:
    # tokenizer_config.json writes special tokens as strings or as AddedToken objects.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any,
    indent: int | None = None,
    ensure_ascii: bool = False,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes <, > and & for HTML; templates expect plain JSON, with the
    # options of json.dumps that transformers lets them pass.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks the assistant's part with it
    (for training masks); rendered for serving, it is its body."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    # The globals and filters transformers gives templates, so that checkpoints' templates work.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _Generation])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = _tojson
    return env
