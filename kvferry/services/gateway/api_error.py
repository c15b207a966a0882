"""The error a client reads: an HTTP status and OpenAI's error body, whose param names the field it is about."""

from starlette.responses import JSONResponse


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}  # the response's own (a 429's retry-after), beside the request's

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def error_response(error: ApiError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers={**(headers or {}), **error.headers})
