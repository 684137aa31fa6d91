"""The OpenAI wire format: request bodies in; responses, stream chunks and errors out.

Parsing is strict on purpose: a field this server does not implement gets a 400 naming it,
never a silent ignore, so a client never believes it got behaviour it did not get. Fields that
have a value meaning "nothing" (n = 1, penalties of 0, no tools, ...) are accepted at that value
or null. Defaults are OpenAI's: temperature 1, top_p 1, max_tokens 16 for completions and the
rest of the context for chat completions. Two non-standard fields are accepted, as vLLM does:
"top_k" and "ignore_eos" (keep generating past the end-of-sequence token: fixed-length outputs
for benchmarks). SGLang's fields that sglang-router adds to what it forwards are no-ops at the
values it sends.

Every response, and the last chunk of a stream before `data: [DONE]`, carries the request's
speculation statistics in the non-standard field "adaspec".
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.sampling import SamplingParams

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
ROLES = ("system", "developer", "user", "assistant")
_SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts
# Stop strings are matched against the output at every step (and held back while streaming): a
# request with thousands of long ones stalled every other client. OpenAI takes 4.
MAX_STOPS = 16
MAX_STOP_CHARS = 1000

# Honoured fields ("top_k" and "ignore_eos" are vLLM's extensions).
_COMMON = frozenset("model max_tokens temperature top_p top_k seed stop stream stream_options user ignore_eos".split())
_COMPLETION_FIELDS = _COMMON | {"prompt"}
_CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens"}

# Known OpenAI fields this server cannot honour: accepted only at the value that asks for nothing.
_NO_OP: Mapping[str, tuple[Any, ...]] = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "suffix": ("",),
    "logprobs": (False,),
    "top_logprobs": (0,),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "logit_bias": ({},),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "response_format": ({"type": "text"},),
    # Chat fields that ask for nothing here: no tools to call in parallel, nothing stored,
    # the standard tier, text out.
    "parallel_tool_calls": (True, False),
    "store": (False,),
    "metadata": ({},),
    "service_tier": ("auto", "default"),
    "modalities": (["text"],),
    # What sglang-router (SGLang's gateway) adds to every request it forwards, at values that ask
    # nothing this server does not do: stop strings trimmed, special tokens left out of the text,
    # no hidden states returned, no reasoning parser to separate or stream with.
    "no_stop_trim": (False,),
    "skip_special_tokens": (True,),
    "return_hidden_states": (False,),
    "continue_final_message": (False,),
    "separate_reasoning": (True, False),
    "stream_reasoning": (True, False),
}
_SHARED_NO_OP = frozenset(
    {"n", "logprobs", "presence_penalty", "frequency_penalty", "logit_bias"}
    | {"no_stop_trim", "skip_special_tokens", "return_hidden_states"}
)
_COMPLETION_NO_OP = _SHARED_NO_OP | {"best_of", "echo", "suffix"}
_CHAT_NO_OP = _SHARED_NO_OP | {
    "top_logprobs",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "response_format",
    "parallel_tool_calls",
    "store",
    "metadata",
    "service_tier",
    "modalities",
    "continue_final_message",
    "separate_reasoning",
    "stream_reasoning",
}
# Message fields a client sends back with an assistant's reply (the OpenAI client's
# `message.model_dump()`): accepted while they hold nothing.
_EMPTY_MESSAGE_FIELDS = frozenset({"tool_calls", "function_call", "refusal", "audio", "annotations"})


class ApiError(Exception):
    """A request the server answers with an error body in OpenAI's format."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str, message: str, code: str | None = None) -> ApiError:
    """A 400 about one field: "<param>: <message>"."""
    return ApiError(400, f"{param}: {message}", param=param, code=code)


# ---- requests ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class GenerateRequest:
    """A completion or chat completion request, validated; the prompt is not tokenized yet."""

    chat: bool
    model: str | None
    prompt: str | tuple[int, ...] | None  # completions: text or token ids
    messages: tuple[dict[str, str], ...]  # chat: {"role", "content"} with text content, and "name" if given
    max_tokens: int | None  # None: the rest of the context (chat)
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool

    def sampling(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed,
            stop=self.stop,
            ignore_eos=self.ignore_eos,
        )


def parse_completion(body: Any) -> GenerateRequest:
    body = _check_fields(body, _COMPLETION_FIELDS, _COMPLETION_NO_OP)
    return _parse(body, chat=False, prompt=_prompt(body), messages=(), max_tokens=_max_tokens(body, chat=False))


def parse_chat(body: Any) -> GenerateRequest:
    body = _check_fields(body, _CHAT_FIELDS, _CHAT_NO_OP)
    return _parse(body, chat=True, prompt=None, messages=_messages(body), max_tokens=_max_tokens(body, chat=True))


def _parse(
    body: Mapping[str, Any],
    *,
    chat: bool,
    prompt: str | tuple[int, ...] | None,
    messages: tuple[dict[str, str], ...],
    max_tokens: int | None,
) -> GenerateRequest:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("model", "must be a string")
    stream = _boolean(body, "stream") or False
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise invalid("stream_options", "is only allowed when stream is true")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise invalid("stream_options", 'must be {"include_usage": true|false}')
        include_usage = _boolean(options, "include_usage", "stream_options.include_usage") or False
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise invalid("user", "must be a string")
    seed = _integer(body, "seed")
    if seed is not None and not _SEED_RANGE[0] <= seed <= _SEED_RANGE[1]:
        raise invalid("seed", "must be a 64-bit integer")
    return GenerateRequest(
        chat=chat,
        model=model,
        prompt=prompt,
        messages=messages,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, lo=0.0, hi=2.0),
        top_p=_number(body, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True),
        top_k=_integer(body, "top_k", lo=0) or 0,
        seed=seed,
        stop=_stop(body),
        ignore_eos=_boolean(body, "ignore_eos") or False,
        stream=stream,
        include_usage=include_usage,
    )


def _check_fields(body: Any, known: frozenset[str], no_op: frozenset[str]) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_body")
    for name in sorted(body):
        if name in no_op:
            value, allowed = body[name], _NO_OP[name]
            if value is not None and not any(_same(value, a) for a in allowed):
                only = ", ".join(json.dumps(a) for a in allowed)
                raise invalid(name, f"not supported by this server (only {only} or null)", "unsupported_value")
        elif name not in known:
            raise ApiError(400, f"Unrecognized request argument supplied: {name}", param=name, code="unknown_parameter")
    return body


def _same(value: Any, allowed: Any) -> bool:
    # In Python, False == 0 and True == 1: a boolean must match a boolean.
    return value == allowed and isinstance(value, bool) == isinstance(allowed, bool)


def _prompt(body: Mapping[str, Any]) -> str | tuple[int, ...]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return tuple(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
        raise invalid("prompt", "only one prompt per request is supported")
    raise invalid("prompt", "must be a string, a list of one string, or a non-empty list of token ids")


def _messages(body: Mapping[str, Any]) -> tuple[dict[str, str], ...]:
    """Each message as {"role", "content"} (and "name" where one is given) for the template; the
    `developer` role is OpenAI's newer name for `system`, and templates know only the older."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "must be a non-empty list of messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid(where, "must be an object")
        role = message.get("role")
        if role not in ROLES:
            raise invalid(f"{where}.role", f"must be one of {', '.join(ROLES)}")
        for key, value in message.items():
            if key in ("role", "content", "name") or (key in _EMPTY_MESSAGE_FIELDS and value in (None, [])):
                continue
            raise invalid(f"{where}.{key}", "not supported by this server", "unsupported_value")
        content = message.get("content")
        if content is None and role == "assistant":
            content = ""  # an assistant's turn may be all tool calls, which hold nothing here
        entry = {"role": "system" if role == "developer" else role, "content": _content(content, f"{where}.content")}
        name = message.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise invalid(f"{where}.name", "must be a string")
            entry["name"] = name
        out.append(entry)
    return tuple(out)


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:  # content parts: only text ones
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(where, 'only text content parts ({"type": "text", "text": ...}) are supported')
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(where, "must be a string or a non-empty list of text parts")


def _max_tokens(body: Mapping[str, Any], *, chat: bool) -> int | None:
    value = _integer(body, "max_tokens", lo=1)
    if chat:
        newer = _integer(body, "max_completion_tokens", lo=1)
        if value is not None and newer is not None and value != newer:
            raise invalid("max_completion_tokens", "contradicts max_tokens: give one of them")
        return value if value is not None else newer
    return value if value is not None else COMPLETION_MAX_TOKENS


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid("stop", "must be a non-empty string or a list of them")
    if len(stops) > MAX_STOPS:
        raise invalid("stop", f"at most {MAX_STOPS} strings, got {len(stops)}")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise invalid("stop", f"each string at most {MAX_STOP_CHARS} characters")
    return tuple(stops)


def _boolean(body: Mapping[str, Any], name: str, param: str | None = None) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise invalid(param or name, "must be true or false")
    return value


def _integer(body: Mapping[str, Any], name: str, *, lo: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(name, "must be an integer")
    if lo is not None and value < lo:
        raise invalid(name, f"must be >= {lo}, got {value}")
    return value


def _number(
    body: Mapping[str, Any], name: str, default: float, *, lo: float, hi: float, lo_open: bool = False
) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise invalid(name, "must be a number")
    if (value <= lo if lo_open else value < lo) or value > hi:
        raise invalid(name, f"must be {'>' if lo_open else '>='} {lo:g} and <= {hi:g}, got {value}")
    return float(value)


# ---- responses --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    def body(self) -> dict[str, int]:
        total = self.prompt_tokens + self.completion_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens, "total_tokens": total}


class Reply:
    """What every body of one response shares, and how each is shaped (completion or chat)."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.model = model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def response(self, text: str, finish_reason: str, usage: Usage, stats: Mapping[str, int]) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice |= {"logprobs": None, "finish_reason": finish_reason}
        body = self._head("chat.completion" if self.chat else "text_completion", [choice])
        return body | {"usage": usage.body(), "adaspec": dict(stats)}

    def chunk(
        self, text: str = "", *, first: bool = False, finish_reason: str | None = None, usage: bool = False
    ) -> dict[str, Any]:
        """One streamed piece of text; a chat stream opens with the role. `usage`: the client asked
        for a usage chunk, so every other chunk has "usage": null."""
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice: dict[str, Any] = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text}
        choice |= {"logprobs": None, "finish_reason": finish_reason}
        body = self._head(self._chunk_object, [choice])
        return body | {"usage": None} if usage else body

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """The extra last chunk of a stream with stream_options.include_usage: no choices."""
        return self._head(self._chunk_object, []) | {"usage": usage.body()}

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _head(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
