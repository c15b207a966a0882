"""What every HTTP request passes before a route: the API key and the body size limit (pure ASGI middleware).

With an API key, every route but an allow-list (/health, /metrics, /version, /openapi.json) needs
`Authorization: Bearer KEY`, compared in constant time: a route added later is closed by default. A body over
the limit gets 413 before the route reads it: by its Content-Length, or by counting a chunked one.
"""

import hmac
import json

OPEN_PATHS = {"/health", "/metrics", "/version", "/openapi.json"}


def _error(status: int, message: str, code: str, kind: str = "invalid_request_error") -> tuple[int, bytes]:
    return status, json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()


class Guards:
    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app = app
        self.api_key = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        # Routed the way Starlette routes: without the root path a proxy or a mount may put in front.
        path = scope["path"]
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]
        if self.api_key and path not in OPEN_PATHS:
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self.api_key):
                what = "missing" if not given else "incorrect"
                return await self._reply(
                    send, *_error(401, f"API key {what}: send 'Authorization: Bearer <key>'", "invalid_api_key")
                )
        length = headers.get(b"content-length")
        too_big = _error(413, f"the request body exceeds {self.max_body_bytes} bytes", "request_too_large")
        if length is not None:
            if not length.isdigit() or int(length) > self.max_body_bytes:
                return await self._reply(send, *too_big)
            return await self.app(scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        # A chunked body: read it here, up to the limit, and hand it on whole.
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                return await self._reply(send, *too_big)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    @staticmethod
    async def _reply(send, status: int, body: bytes) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})
