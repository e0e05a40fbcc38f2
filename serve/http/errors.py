"""The OpenAI error shape and the JSON responses of the server (safe for any text a client sent)."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse as _StarletteJSONResponse


class JSONResponse(_StarletteJSONResponse):
    """JSON with non-ASCII characters escaped: text taken from a request (a field name, a model id) may
    hold lone surrogates, which UTF-8 cannot encode but a \\uXXXX escape can."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def show(value: Any, limit: int = 80) -> str:
    """A short, printable rendering of a client's value for an error message."""
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (ValueError, TypeError, RecursionError):
        text = type(value).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


class APIError(Exception):
    """An error answered as OpenAI JSON: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class QueueFull(Exception):
    """More requests would wait for a slot than the server allows."""


class Unavailable(Exception):
    """The engine loop is stopping or has failed."""
