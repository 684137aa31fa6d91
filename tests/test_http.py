"""The OpenAI-compatible HTTP API and /metrics of the daemon as a real subprocess on the default
models, through the official `openai` client and plain httpx.

No generated text is written down here: greedy output must equal target-only decoding
(`engine.generate.generate`) of the same checkpoint, decoded the same way. Requests that must
still be running a moment later ask for `ignore_eos` (a vLLM-style extension) and many tokens.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.chat_template import ChatTemplate
from engine.checkpoint import Checkpoint, load_checkpoint
from engine.generate import generate
from engine.sampling import SamplingParams
from tests.conftest import DEFAULT_TARGET
from tests.test_daemon import Daemon, start_daemon, stop_daemon

MODEL = DEFAULT_TARGET.name
PROMPT = "def fibonacci(n):"
MESSAGES = [
    {"role": "system", "content": "You write short Python functions."},
    {"role": "user", "content": "Compute the n-th Fibonacci number."},
]
TOOL_MESSAGE = {"role": "tool", "content": "42", "tool_call_id": "a"}
CALLING = {"role": "assistant", "content": None, "tool_calls": [{"id": "a"}]}
MAX_TOKENS = 12
LONG = 480  # with the daemon's max_seq_len of 512: a request that is still running moments later
STATE_METRICS = (
    "adaspec_k",
    "adaspec_threads",
    "adaspec_requests_in_flight",
    "adaspec_config_generation",
    "adaspec_config_reload_failures_total",
    "adaspec_runtime_state_build_seconds",
    "adaspec_runtime_state_memory_bytes",
)


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    d = start_daemon(Path(tempfile.mkdtemp(prefix="adaspecd-", dir="/tmp")), max_batch_size=4)
    yield d
    stop_daemon(d)


@pytest.fixture(scope="module")
def url(daemon: Daemon) -> str:
    return daemon.url


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def target() -> Checkpoint:
    return load_checkpoint(DEFAULT_TARGET)


def reference(target: Checkpoint, prompt: list[int], max_tokens: int) -> tuple[str, str, int]:
    """Target-only greedy text, finish reason and token count."""
    (completion,) = generate(target, [prompt], SamplingParams(max_tokens=max_tokens))
    return target.tokenizer.decode(completion.tokens), completion.finish_reason, len(completion.tokens)


def chat_prompt(target: Checkpoint) -> list[int]:
    template = ChatTemplate.from_checkpoint(DEFAULT_TARGET)
    return target.tokenizer.encode(template.render(MESSAGES), add_special_tokens=not template.adds_special_tokens).ids


def metrics(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics, parsed by prometheus_client, by (name, sorted labels)."""
    text = httpx.get(f"{url}/metrics").text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def total(samples: dict[tuple[str, tuple], float], name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


def assert_openai_error(response: httpx.Response, status: int, code: str | None, param: str | None = None) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and error["param"] == param and error["message"]
    return error["message"]


def test_health_models_and_the_address_in_admin_status(daemon, url):
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    models = httpx.get(f"{url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert url.endswith(daemon.status()["http"])
    assert any(e.get("address") == daemon.status()["http"] for e in daemon.events("http listening"))


def test_completions_equal_target_only_greedy_output(client, target):
    prompt = target.tokenizer.encode(PROMPT).ids
    text, reason, tokens = reference(target, prompt, MAX_TOKENS)

    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert response.choices[0].text == text and response.choices[0].finish_reason == reason
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(prompt), tokens)
    stats = response.to_dict()["adaspec"]
    assert set(stats) == {"rounds", "accepted_drafts", "proposed_drafts", "k"}
    assert 0 <= stats["accepted_drafts"] <= stats["proposed_drafts"]

    usage = {"include_usage": True}
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True, stream_options=usage
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [reason]
    assert chunks[-1].usage.completion_tokens == tokens and "adaspec" in chunks[-1].to_dict()


def test_chat_completions_equal_target_only_greedy_output(client, target):
    text, reason, tokens = reference(target, chat_prompt(target), MAX_TOKENS)

    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    message = response.choices[0].message
    assert message.role == "assistant" and message.content == text
    assert response.choices[0].finish_reason == reason and response.usage.completion_tokens == tokens
    assert "adaspec" in response.to_dict()

    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == reason and "adaspec" in chunks[-1].to_dict()


def test_a_stop_string_ends_the_text_before_it(client, target):
    text, _, _ = reference(target, target.tokenizer.encode(PROMPT).ids, 24)
    if len(text) < 4:
        pytest.skip("the default model ends this prompt too soon to pick a stop string from its output")
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    expected = text[: text.find(stop)]

    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert response.choices[0].text == expected and response.choices[0].finish_reason == "stop"
    chunks = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in chunks) == expected


def test_sixteen_concurrent_streaming_clients_all_complete(daemon, client):
    def stream(i: int) -> tuple[str, str | None]:
        chunks = list(client.completions.create(model=MODEL, prompt=f"{PROMPT}  # {i}", max_tokens=6, stream=True))
        return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason

    with ThreadPoolExecutor(16) as pool:  # max_batch_size is 4: most of them queue
        results = list(pool.map(stream, range(16)))
    assert all(reason in ("stop", "length") for _, reason in results)
    daemon.wait_for(lambda: daemon.status()["in_flight"] == 0, 10, "in_flight to return to 0")


@pytest.mark.parametrize(
    ("path", "body", "status", "code", "param"),
    [
        ("/v1/completions", b'{"prompt": "x", ', 400, "invalid_json", None),
        ("/v1/completions", b'["x"]', 400, "invalid_body", None),
        ("/v1/completions", {"prompt": "x", "frobnicate": 1}, 400, "unknown_parameter", "frobnicate"),
        ("/v1/completions", {"prompt": "x", "n": 2}, 400, "unsupported_value", "n"),
        ("/v1/completions", {"prompt": "x", "logprobs": 2}, 400, "unsupported_value", "logprobs"),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, None, "temperature"),
        ("/v1/completions", {"prompt": "x", "model": "gpt-4o"}, 404, "model_not_found", "model"),
        ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{}]}, 400, "unsupported_value", "tools"),
        ("/v1/chat/completions", {"messages": []}, 400, None, "messages"),
        ("/v1/completions", {"prompt": "x", "stop": [f"s{i}" for i in range(17)]}, 400, None, "stop"),
        ("/v1/completions", {"prompt": "x", "stop": "s" * 1001}, 400, None, "stop"),
        ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}', 400, "invalid_json", None),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udc00"}]}', 400, "invalid_json", None),
        ("/v1/chat/completions", {"messages": [TOOL_MESSAGE]}, 400, None, "messages[0].role"),
        ("/v1/chat/completions", {"messages": [CALLING]}, 400, "unsupported_value", "messages[0].tool_calls"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": []}]}, 400, None, "messages[0].content"),
        ("/v1/chat/completions", {"messages": MESSAGES, "store": True}, 400, "unsupported_value", "store"),
        ("/v1/completions", {"prompt": "x", "no_stop_trim": True}, 400, "unsupported_value", "no_stop_trim"),
        ("/v1/completions", {"prompt": [99_999_999]}, 400, "invalid_prompt", "prompt"),
    ],
    ids=[
        "malformed-json",
        "not-an-object",
        "unknown-field",
        "n=2",
        "logprobs",
        "temperature",
        "wrong-model",
        "tools",
        "no-messages",
        "too-many-stops",
        "a-stop-too-long",
        "lone-surrogate",
        "lone-surrogate-in-chat",
        "tool-role",
        "tool-calls",
        "no-content-parts",
        "store",
        "no-stop-trim",
        "id-outside-vocab",
    ],
)
def test_bad_requests_get_openai_errors(url, path, body, status, code, param):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    assert_openai_error(httpx.post(f"{url}{path}", **kwargs), status, code, param)


def test_a_conversation_sent_back_as_the_client_returns_it_is_served(client, target):
    """The usual loop: the assistant's reply goes back in as the client dumps it (tool_calls,
    refusal, annotations, ... all null), beside a named user, a developer message and OpenAI's
    fields that ask for nothing here."""
    first = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0)
    reply = first.choices[0].message.model_dump()
    assert reply["tool_calls"] is None and reply["refusal"] is None
    messages = [
        {"role": "developer", "content": MESSAGES[0]["content"]},
        {**MESSAGES[1], "name": "ada"},
        reply,
        {"role": "user", "content": "Shorter."},
    ]
    extras = {"store": False, "parallel_tool_calls": False, "metadata": {}, "service_tier": "auto"}
    second = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, extra_body=extras
    )
    # The plain fallback renders the developer message as the system one it replaces.
    plain = [MESSAGES[0], MESSAGES[1], {"role": "assistant", "content": reply["content"]}, messages[3]]
    prompt = target.tokenizer.encode(ChatTemplate.from_checkpoint(DEFAULT_TARGET).render(plain)).ids
    assert second.choices[0].message.content == reference(target, prompt, MAX_TOKENS)[0]


# What sglang-router adds to each request it forwards (0.3), at the values it sends.
ROUTER_FIELDS = {"no_stop_trim": False, "skip_special_tokens": True, "return_hidden_states": False}
ROUTER_CHAT_FIELDS = ROUTER_FIELDS | {
    "continue_final_message": False,
    "separate_reasoning": True,
    "stream_reasoning": True,
}


def test_the_fields_a_router_adds_are_served_as_without_them(client):
    """Behind sglang-router every request carries SGLang's own fields at values that ask for
    nothing this server does not do: the same reply as without them."""
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    routed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body=ROUTER_FIELDS
    )
    assert routed.choices[0].text == plain.choices[0].text
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, extra_body=ROUTER_CHAT_FIELDS
    )
    assert chat.choices[0].finish_reason in ("stop", "length")


def test_http_errors_say_what_the_path_takes(url):
    response = httpx.get(f"{url}/v1/chat/completions")
    assert_openai_error(response, 405, None, None)
    assert response.headers["allow"] == "POST"
    listed = httpx.get(f"{url}/v1/models/")
    assert listed.status_code == 200 and [m["id"] for m in listed.json()["data"]] == [MODEL]


def test_max_tokens_past_the_context_names_the_numbers(url, client):
    response = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 600})
    message = assert_openai_error(response, 400, "context_length_exceeded", "max_tokens")
    assert "512" in message and "600" in message
    # A prompt no tokenization could fit is refused by its length alone, before the tokenizer
    # spends seconds on it with every other client waiting.
    for path, body in (
        ("/v1/completions", {"prompt": "word " * 200_000}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 200_000}]}),
    ):
        response = httpx.post(f"{url}{path}", json=body)
        param = "prompt" if "prompt" in body else "messages"
        message = assert_openai_error(response, 400, "context_length_exceeded", param)
        assert "512 tokens; a prompt of 1000" in message
    # A chat that leaves max_tokens to the server and fills the context blames its messages.
    long = [{"role": "user", "content": " x" * 600}]
    message = assert_openai_error(
        httpx.post(f"{url}/v1/chat/completions", json={"messages": long}), 400, "context_length_exceeded", "messages"
    )
    assert "512 tokens" in message and "leaving none to generate" in message
    with pytest.raises(openai.BadRequestError):  # the client raises the error type for the status
        client.completions.create(model=MODEL, prompt="x", n=2)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="x")


def test_a_prompt_alone_over_the_context_names_the_prompt_whatever_max_tokens_says(url, target):
    """Issue 64: a prompt that fills the context by itself is the prompt's fault, max_tokens given
    or not; max_tokens is named only when the prompt fits and the two together do not."""
    (x,) = target.tokenizer.encode(" x", add_special_tokens=False).ids
    chat = [{"role": "user", "content": " x" * 600}]
    for path, body, param, size in (
        ("/v1/completions", {"prompt": [x] * 512, "max_tokens": 4}, "prompt", 512),  # exactly the context
        ("/v1/completions", {"prompt": [x] * 600, "max_tokens": 4}, "prompt", 600),
        ("/v1/completions", {"prompt": [x] * 600}, "prompt", 600),  # the default max_tokens, 16
        ("/v1/chat/completions", {"messages": chat, "max_tokens": 4}, "messages", None),
    ):
        message = assert_openai_error(httpx.post(f"{url}{path}", json=body), 400, "context_length_exceeded", param)
        assert f"the {param} alone take" in message and "leaving none to generate" in message, message
        assert "max_tokens" not in message
        if size is not None:
            assert f"take {size}," in message or f"takes {size}," in message
    # The prompt fits (500 of 512); with max_tokens 20 the request does not: max_tokens is named.
    response = httpx.post(f"{url}/v1/completions", json={"prompt": [x] * 500, "max_tokens": 20})
    message = assert_openai_error(response, 400, "context_length_exceeded", "max_tokens")
    assert "needs 520 (500 in the prompt, max_tokens 20)" in message


def test_a_client_that_disconnects_has_its_request_cancelled(daemon, url):
    body = {"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True}
    before = daemon.status()["tokens"]
    closed = total(metrics(url), "adaspec_http_requests_total", status="499")
    with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}) as response:
        assert next(response.iter_lines()).startswith("data: ")  # generating: now hang up
    daemon.wait_for(lambda: daemon.status()["in_flight"] == 0, 10, "the streamed request to be cancelled")
    # Its 200 had gone out with the headers; the metrics count what happened: the client left.
    daemon.wait_for(
        lambda: total(metrics(url), "adaspec_http_requests_total", status="499") == closed + 1, 5, "a 499 counted"
    )
    with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up waiting
        httpx.post(f"{url}/v1/completions", json=body, timeout=0.3)
    daemon.wait_for(lambda: daemon.status()["in_flight"] == 0, 10, "the non-streamed request to be cancelled")
    assert daemon.status()["tokens"] - before < 2 * LONG  # neither ran to its end
    assert total(metrics(url), "adaspec_http_requests_total", status="499") == closed + 2
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_metrics_parse_and_move_with_requests(url, client):
    before = metrics(url)
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    after = metrics(url)

    def moved(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert moved("adaspec_http_requests_total", endpoint="/v1/completions", status="200") == 1
    assert moved("adaspec_http_request_duration_seconds_count", endpoint="/v1/completions") == 1
    assert moved("adaspec_time_to_first_token_seconds_count") == 1
    assert moved("adaspec_generated_tokens_total") == response.usage.completion_tokens
    assert moved("adaspec_rounds_total") == response.to_dict()["adaspec"]["rounds"]
    assert moved("adaspec_accepted_drafts_count") == response.to_dict()["adaspec"]["rounds"]
    assert moved("adaspec_sequence_rounds_total") == response.to_dict()["adaspec"]["rounds"]  # one sequence
    assert set(STATE_METRICS) <= {name for name, _ in after}
    assert total(after, "adaspec_k") in {1, 3, 7}


def test_a_connection_that_never_finishes_its_headers_is_closed(url):
    import socket
    import time

    from daemon import http

    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=http.HEADERS_TIMEOUT_S + 10) as half:
        half.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and never the blank line that ends them
        started = time.monotonic()
        assert half.recv(1024) == b""  # closed by the server, with nothing sent
        assert http.HEADERS_TIMEOUT_S - 1 < time.monotonic() - started < http.HEADERS_TIMEOUT_S + 5
    assert httpx.get(f"{url}/health").status_code == 200  # requests that finish their headers are served


@pytest.fixture(scope="module")
def small() -> Iterator[Daemon]:
    """One sequence at a time and no queue: a second request in flight is one too many."""
    d = start_daemon(Path(tempfile.mkdtemp(prefix="adaspecd-", dir="/tmp")), max_batch_size=1, server="max_queue = 0")
    yield d
    stop_daemon(d)


def test_requests_beyond_capacity_get_503_with_retry_after(small):
    url = small.url
    body = {"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body) as response:
        lines = response.iter_lines()  # kept: an abandoned iterator closes the connection
        assert next(lines).startswith("data: ")  # the one slot is taken
        refused = httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2})
        assert_openai_error(refused, 503, "overloaded")
        assert refused.json()["error"]["type"] == "server_error" and int(refused.headers["Retry-After"]) >= 1
    small.wait_for(lambda: small.status()["in_flight"] == 0, 10, "the slot to be freed")
    assert httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_sigterm_refuses_new_requests_and_lets_in_flight_ones_finish(small):
    url = small.url
    body = {"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        before = metrics(url)
        small.process.send_signal(signal.SIGTERM)
        small.wait_for(lambda: httpx.get(f"{url}/health").status_code == 503, 5, "/health to report draining")
        assert httpx.get(f"{url}/health").json() == {"status": "draining"}
        assert_openai_error(httpx.post(f"{url}/v1/completions", json={"prompt": "x"}), 503, "draining")
        # The 503s of the drain are counted like every other answer.
        during = metrics(url)
        refused = {
            endpoint: total(during, "adaspec_http_requests_total", endpoint=endpoint, status="503")
            - total(before, "adaspec_http_requests_total", endpoint=endpoint, status="503")
            for endpoint in ("/v1/completions", "/health")
        }
        assert refused["/v1/completions"] == 1 and refused["/health"] >= 2, refused  # /health: at least the last two
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]" and '"finish_reason": "length"' in rest[-2]
    assert small.process.wait(30) == 0


def test_requests_left_at_the_drain_deadline_are_ended_with_an_error_the_client_can_read():
    # A deadline far shorter than the two long requests: they are still running when it passes.
    folder = Path(tempfile.mkdtemp(prefix="adaspecd-", dir="/tmp"))
    daemon = start_daemon(folder, shutdown="drain_timeout_s = 0.05")
    url = daemon.url
    body = {"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True, "temperature": 1.0}
    with ThreadPoolExecutor(1) as pool:
        with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}, timeout=60) as response:
            lines = response.iter_lines()
            whole = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=60)
            assert next(lines).startswith("data: ")
            daemon.wait_for(lambda: daemon.status()["in_flight"] == 2, 10, "both requests to be in flight")
            daemon.process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert_openai_error(whole.result(), 503, "shutdown")
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2].removeprefix("data: "))["error"]
    assert error["code"] == "shutdown" and "shut down before this request finished" in error["message"]
    assert daemon.process.wait(30) == 0
    assert daemon.events("drain deadline passed") and not daemon.events("request failed")
    daemon.notify.close()


KEY = "sk-adaspec-test-0123"


@pytest.fixture(scope="module")
def keyed() -> Iterator[Daemon]:
    """The API behind a key read from a file, /metrics too."""
    folder = Path(tempfile.mkdtemp(prefix="adaspecd-", dir="/tmp"))
    (folder / "api_key").write_text(KEY + "\n")
    d = start_daemon(folder, server=f'api_key_file = "{folder / "api_key"}"\nmetrics_need_key = true')
    yield d
    stop_daemon(d)


def test_an_api_key_guards_every_v1_route_and_the_right_one_serves(keyed, target):
    url = keyed.url
    right = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
    text, _, _ = reference(target, target.tokenizer.encode(PROMPT).ids, MAX_TOKENS)
    completion = right.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert completion.choices[0].text == text
    assert [m.id for m in right.models.list()] == [MODEL]
    for key in ("sk-wrong", KEY + "x", KEY[:-1]):
        wrong = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError) as caught:
            wrong.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            wrong.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
    for method, path in [
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/models"),
        ("GET", f"/v1/models/{MODEL}"),
        ("GET", "/v1/no-such-route"),
    ]:
        response = httpx.request(method, url + path, json={"prompt": PROMPT, "max_tokens": 2})
        message = assert_openai_error(response, 401, "invalid_api_key")
        assert "no API key" in message and response.headers["WWW-Authenticate"] == "Bearer"
    assert httpx.get(f"{url}/health").status_code == 200  # open: for load balancers and systemd
    assert httpx.get(f"{url}/metrics").status_code == 401
    assert httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    # The scheme's case does not matter (RFC 7235); another scheme, or the key alone, is refused.
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"bearer {KEY}"}).status_code == 200
    for refused in (f"Basic {KEY}", KEY, f"Bearer{KEY}"):
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": refused}).status_code == 401
    code, config = keyed.ctl("config")
    assert KEY not in json.dumps(config)  # the file's path is shown, never the key


def test_curl_with_and_without_the_key(keyed):
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("no curl on this machine")
    models = f"{keyed.url}/v1/models"
    status = ["-s", "-o", "/dev/null", "-w", "%{http_code}"]
    with_key = subprocess.run([curl, *status, "-H", f"Authorization: Bearer {KEY}", models], capture_output=True)
    without = subprocess.run([curl, *status, models], capture_output=True)
    assert (with_key.stdout, without.stdout) == (b"200", b"401")


def test_serving_your_own_checkpoint_as_the_readme_says(tmp_path):
    """A checkpoint saved by transformers (a tiny random Llama, given the default tokenizer) with
    the n-gram drafter: the README's "Serving your own model", followed to a completion."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=8192,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    transformers.set_seed(0)
    own = tmp_path / "my-llama"
    transformers.LlamaForCausalLM(config).save_pretrained(own)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_TARGET / name, own / name)
    daemon = start_daemon(
        Path(tempfile.mkdtemp(prefix="adaspecd-", dir="/tmp")), target=own, engine='drafter = "ngram"'
    )
    try:
        client = openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="unused", max_retries=0, timeout=60)
        completion = client.completions.create(model="my-llama", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
        mine = load_checkpoint(own)
        assert completion.choices[0].text == reference(mine, mine.tokenizer.encode(PROMPT).ids, MAX_TOKENS)[0]
    finally:
        stop_daemon(daemon)


def test_serving_a_gguf_file_as_the_readme_says(tmp_path):
    """engine.target naming a GGUF file (the default target, stored as Q8_0): the model id is the
    file's name less .gguf, completions are the loaded file's, and chats use its template."""
    import gguf

    from tests.gguf_files import write_gguf

    own = write_gguf(DEFAULT_TARGET, tmp_path / "my-model.gguf", gguf.GGMLQuantizationType.Q8_0)
    daemon = start_daemon(
        Path(tempfile.mkdtemp(prefix="adaspecd-", dir="/tmp")), target=own, engine='drafter = "ngram"'
    )
    try:
        client = openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list()] == ["my-model"]
        completion = client.completions.create(model="my-model", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
        mine = load_checkpoint(own)
        assert completion.choices[0].text == reference(mine, mine.tokenizer.encode(PROMPT).ids, MAX_TOKENS)[0]
        messages = [{"role": "user", "content": PROMPT}]
        chat = client.chat.completions.create(model="my-model", messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        rendered = ChatTemplate.from_checkpoint(own).render(messages)
        assert rendered.startswith("<|im_start|>user\n")
        expected = reference(mine, mine.tokenizer.encode(rendered, add_special_tokens=False).ids, MAX_TOKENS)[0]
        assert chat.choices[0].message.content == expected
    finally:
        stop_daemon(daemon)


def test_the_listening_socket_sends_each_write_without_waiting_for_an_ack():
    """A response goes out as two writes (headers, then body): with Nagle's algorithm on, a
    keep-alive connection's every later response waited 40 ms for the client's delayed ACK. The
    daemon's connections have it off, and say they are TCP (asyncio turns it off only then)."""
    import socket

    from daemon.http import _bind

    listening = _bind("127.0.0.1", 0)
    listening.setblocking(True)
    client = socket.create_connection(listening.getsockname()[:2])
    accepted, _ = listening.accept()
    try:
        assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        assert accepted.proto == socket.IPPROTO_TCP
    finally:
        for s in (accepted, client, listening):
            s.close()


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="thread names are read from /proc (Linux)")
def test_the_engine_thread_is_named_for_top(daemon):
    """`top -H` and `ps -L` show the thread that loads, builds and runs the engine by its name."""
    tasks = Path(f"/proc/{daemon.process.pid}/task")
    names = [(task / "comm").read_text().strip() for task in tasks.iterdir()]
    assert "adaspec-engine" in names
