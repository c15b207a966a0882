"""What every request passes before a route (pure ASGI middleware): the API key, the body's type and its size.

With an API key, every route but an allow-list needs `Authorization: Bearer KEY`, compared in constant time, so a
route added later is closed by default; every kind of connection but lifespan is checked, WebSockets included. A POST
with a JSON body must say so (`application/json` or `application/*+json`) or get 415 before it is read: else a web
page could post a form to a gateway on localhost without the browser's CORS preflight. A body over the limit gets 413
before the route reads it, by its Content-Length or by counting a chunked one (then handed on whole, with its length).
"""

import hmac
import json

from kvferry.services.gateway.admission import RETRY_AFTER, Admission
from kvferry.services.gateway.api_error import ApiError

OPEN_PATHS = {"/health", "/metrics", "/version", "/openapi.json"}
WEBSOCKET_POLICY_VIOLATION = 1008


def is_json(content_type: bytes | None) -> bool:
    """application/json or application/<anything>+json, in any case, with or without parameters."""
    if content_type is None:
        return False
    media = content_type.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or (media.startswith(b"application/") and media.endswith(b"+json"))


class Guards:
    def __init__(
        self,
        app,
        api_key: str | None,
        max_body_bytes: int,
        json_paths: frozenset[str] = frozenset(),
        admission: Admission | None = None,
    ):
        """json_paths: the routes whose POST body is JSON; admission: what a chunked body is read under."""
        self.app, self.admission = app, admission
        self.api_key = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.json_paths = json_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        # Routed the way Starlette routes: without the root path a proxy or a mount may put in front.
        path = scope["path"]
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]
        if self.api_key and path not in OPEN_PATHS:
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self.api_key):
                return await self._refuse(scope, receive, send, "missing" if not given else "incorrect")
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["method"] == "POST" and path in self.json_paths and not is_json(headers.get(b"content-type")):
            message = "the body must be JSON: send 'Content-Type: application/json'"
            return await self._reply(send, ApiError(415, message, code="unsupported_media_type"))
        length = headers.get(b"content-length")
        too_big = ApiError(413, f"the request body exceeds {self.max_body_bytes} bytes", code="request_too_large")
        if length is not None:
            # Compared by its digits first: int() refuses strings of thousands of digits.
            if not length.isdigit() or len(length) > 18 or int(length) > self.max_body_bytes:
                return await self._reply(send, too_big)
            return await self.app(scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        # A chunked body: read it here, up to the limit, under a reservation of the limit (its size is known only once
        # read, and until then it is memory that the bytes let in must count), and hand it on whole.
        if self.admission is not None and not self.admission.reserve_bytes(self.max_body_bytes):
            message = (
                f"too many request bytes waiting to send a chunked body of up to {self.max_body_bytes}; retry shortly"
            )
            refusal = ApiError(429, message, code="rate_limit_error", kind="rate_limit_error", headers=RETRY_AFTER)
            return await self._reply(send, refusal)
        try:
            body = await self._read_chunked(receive)
        finally:
            if self.admission is not None:
                self.admission.release_bytes(self.max_body_bytes)
        if body is None:
            return await self._reply(send, too_big)
        if body is False:
            return  # the client left
        # Handed on as a body of known length: what the API's admission charges (admission.py) before reading it.
        scope = {**scope, "headers": [*scope.get("headers", ()), (b"content-length", str(len(body)).encode())]}
        unread = [{"type": "http.request", "body": body, "more_body": False}]

        async def replay():
            return unread.pop() if unread else await receive()

        return await self.app(scope, replay, send)

    async def _read_chunked(self, receive) -> bytes | None | bool:
        """The whole body; None past --max-body-size, False when the client left first."""
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return False
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                return None
            more = message.get("more_body", False)
        return b"".join(chunks)

    async def _refuse(self, scope, receive, send, what: str) -> None:
        """A connection without the right key: 401 over HTTP, a close before the accept for a WebSocket, and nothing
        at all for a kind of connection this middleware does not know."""
        if scope["type"] == "http":
            message = f"API key {what}: send 'Authorization: Bearer <key>'"
            await self._reply(send, ApiError(401, message, code="invalid_api_key"))
        elif scope["type"] == "websocket" and (await receive())["type"] == "websocket.connect":
            await send({"type": "websocket.close", "code": WEBSOCKET_POLICY_VIOLATION, "reason": f"API key {what}"})

    @staticmethod
    async def _reply(send, error: ApiError) -> None:
        body = json.dumps(error.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += [(name.encode(), value.encode()) for name, value in error.headers.items()]
        await send({"type": "http.response.start", "status": error.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
