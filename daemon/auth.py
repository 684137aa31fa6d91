"""API keys: every /v1 route (and /metrics, where configured) needs `Authorization: Bearer KEY`.

The key comes from `[server] api_key`, the file `[server] api_key_file` names, or the
environment variable ADASPEC_API_KEY, so that it can stay out of config.toml (and out of
`adaspecctl config`, which hides it). Keys are compared in constant time.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from control.load import read_key_file
from control.settings import ServerSettings
from daemon.protocol import ApiError

ENV_VAR = "ADASPEC_API_KEY"


def api_key(settings: ServerSettings, environ: Mapping[str, str] = os.environ) -> str | None:
    """The key the API requires, or None where none is set (the API is open)."""
    if settings.api_key is not None:
        return settings.api_key
    if settings.api_key_file is not None:
        return read_key_file(settings.api_key_file)
    return environ.get(ENV_VAR) or None


class ApiKeyMiddleware:
    """Answers 401, in OpenAI's error shape, to a protected request without the right key."""

    def __init__(self, app: ASGIApp, key: str, protect_metrics: bool = False) -> None:
        self.app = app
        self.expected = key.encode()
        self.protect_metrics = protect_metrics

    def protects(self, path: str) -> bool:
        return path.startswith("/v1/") or path == "/v1" or (self.protect_metrics and path == "/metrics")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.protects(scope["path"]):
            await self.app(scope, receive, send)
            return
        given = next((value for name, value in scope["headers"] if name == b"authorization"), None)
        scheme, _, credentials = (given or b"").partition(b" ")
        # The scheme is case-insensitive (RFC 7235): "bearer KEY" is as good as "Bearer KEY".
        if scheme.lower() == b"bearer" and hmac.compare_digest(credentials.strip(), self.expected):
            await self.app(scope, receive, send)
            return
        reason = "no API key was given" if given is None else "the API key is not valid"
        error = ApiError(
            401,
            f"Incorrect or missing API key: {reason}. Send it as 'Authorization: Bearer KEY'.",
            code="invalid_api_key",
        )
        response = JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
