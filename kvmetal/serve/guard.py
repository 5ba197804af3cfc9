"""What every HTTP request passes before a route sees it: the API key and the body size limit.

An ASGI middleware, so it runs before FastAPI reads anything:

- ``api_key``: without ``Authorization: Bearer <key>`` (compared in constant time), every
  route but ``/health`` answers 401.
- ``max_body_bytes``: a body past it answers 413, whether its ``Content-Length`` says so
  up front or a chunked body grows past it while it is read. The rest of the body is
  read and dropped (up to ``DRAIN_LIMIT`` bytes, never kept), so that the client, still
  sending, reads the 413 instead of a reset connection.

Refusals are OpenAI-style error bodies and are counted in ``rejected`` (status -> count).
"""
from __future__ import annotations

import hmac
import json

from .protocol import APIError

DRAIN_LIMIT = 64 << 20  # bytes of an oversized body read and dropped before answering


class BodyTooLarge(APIError):
    """Raised by the wrapped ``receive`` when a chunked body grows past the limit (the
    app's APIError handler turns it into the 413)."""

    def __init__(self, limit: int):
        super().__init__(f"the request body is over the server's body limit of {limit} bytes (--max-body-bytes)",
                         status=413, code="request_too_large")


def error_body(message: str, type_: str, code: str | None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()


class Guard:
    """ASGI middleware: API key and body limit. ``rejected`` counts refusals by status."""

    def __init__(self, app, *, api_key: str | None, max_body_bytes: int | None, rejected: dict):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.rejected = rejected

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.api_key is not None and scope.get("path") != "/health":
            given = headers.get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                await _drain(receive)
                return await self._refuse(send, 401, "a valid API key is required: send 'Authorization: Bearer "
                                          "<key>' (the server's --api-key)", "invalid_request_error",
                                          "invalid_api_key", [(b"www-authenticate", b"Bearer")])
        limit = self.max_body_bytes
        if limit is None:
            return await self.app(scope, receive, send)
        try:
            declared = int(headers.get(b"content-length", b"-1"))
        except ValueError:
            declared = -1
        if declared > limit:
            await _drain(receive)
            return await self._too_large(send, declared)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    if message.get("more_body", False):
                        await _drain(receive)
                    self.rejected[413] = self.rejected.get(413, 0) + 1
                    raise BodyTooLarge(limit)
            return message

        started = False

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracked_send)
        except BodyTooLarge as e:  # raised outside the app's handlers
            if not started:
                await self._refuse(send, 413, str(e), e.type, e.code, count=False)

    async def _too_large(self, send, size: int) -> None:
        what = f"{size} bytes" if size >= 0 else "the request body"
        await self._refuse(send, 413, f"{what} is over the server's body limit of {self.max_body_bytes} bytes "
                                      f"(--max-body-bytes)", "invalid_request_error", "request_too_large")

    async def _refuse(self, send, status: int, message: str, type_: str, code: str, extra=(),
                      count: bool = True) -> None:
        if count:
            self.rejected[status] = self.rejected.get(status, 0) + 1
        body = error_body(message, type_, code)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close"), *extra]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


async def _drain(receive) -> None:
    """Read and drop the rest of a request body (at most DRAIN_LIMIT bytes)."""
    dropped = 0
    while dropped <= DRAIN_LIMIT:
        message = await receive()
        if message["type"] != "http.request":
            return
        dropped += len(message.get("body", b""))
        if not message.get("more_body", False):
            return
