"""Chat messages to a prompt: the checkpoint's own chat template, or a plain fallback.

The template is the Jinja2 text in the checkpoint's `tokenizer_config.json` ("chat_template",
a string or a list of named templates, of which "default" is used) or in `chat_template.jinja`,
rendered as transformers' `apply_chat_template` does: in a sandbox, with `messages`,
`add_generation_prompt=True`, `bos_token` and `eos_token`, and `tools` and `documents` set to
none (templates test them with `is not none`, and an undefined one is not none). Templates put the special tokens in
themselves, so their text is tokenized without adding any.

A checkpoint with no template (such as a base model) gets the plain fallback: one
"role: content" line per message, then "assistant: " for the model to continue. It is tokenized
like a completion prompt.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

Message = Mapping[str, str]  # {"role": ..., "content": ...}, and "name" where the client gave one


class ChatTemplateError(ValueError):
    """The template refused the messages (a `raise_exception` in it) or failed to render."""


class ChatTemplate:
    def __init__(self, source: str | None = None, bos_token: str = "", eos_token: str = "") -> None:
        """`source` is the Jinja2 text, or None for the plain fallback."""
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._template = _environment().from_string(source) if source is not None else None

    @classmethod
    def from_checkpoint(cls, path: Path) -> ChatTemplate:
        config = _read_json(path / "tokenizer_config.json")
        source = config.get("chat_template")
        if isinstance(source, list):  # [{"name": ..., "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default", next(iter(named.values()), None))
        jinja_file = path / "chat_template.jinja"
        if not source and jinja_file.exists():
            source = jinja_file.read_text()
        return cls(source or None, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))

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
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                tools=None,
                documents=None,
            )
        except TemplateError as err:
            raise ChatTemplateError(f"the chat template rejected the messages: {err}") from None


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


def _tojson(value: Any, indent: int | None = None) -> str:
    # Jinja's own tojson escapes <, > and & for HTML; templates expect plain JSON.
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _environment() -> ImmutableSandboxedEnvironment:
    # The globals and filters transformers gives templates, so that checkpoints' templates work.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = _tojson
    return env
