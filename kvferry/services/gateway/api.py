"""The OpenAI-compatible HTTP API (Starlette): completions, chat completions, models, health, workers."""
import contextlib
import json
import logging
import math
import time
import uuid

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvferry.common import tracing
from kvferry.common.errors import InvalidRequest
from kvferry.common.logs import request_id_var
from kvferry.common.sampling import SamplingParams
from kvferry.common.sequence import FinishReason
from kvferry.services.gateway.detokenizer import IncrementalText
from kvferry.services.gateway.metrics import GatewayMetrics
from kvferry.services.gateway.request_trace import RequestTrace
from kvferry.services.gateway.server import GatewayCore, NoWorkers

log = logging.getLogger("kvferry.gateway")
FINISH_NAMES = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}
MAX_STOP_STRINGS = 16
# Parameters kvferry does not honour yet, with the value that asks for nothing (False == 0 in Python).
NOT_YET_SUPPORTED = {"logprobs": None, "top_logprobs": 0, "echo": False, "best_of": 1, "presence_penalty": 0,
                     "frequency_penalty": 0, "logit_bias": {}, "repetition_penalty": 1}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self, headers: dict | None = None) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=headers)


def _field(body: dict, name: str, types: tuple, default=None, check=None, what: str = ""):
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, types) or isinstance(value, bool) and bool not in types:
        raise ApiError(400, f"'{name}' must be {what or ' or '.join(t.__name__ for t in types)}", name)
    if isinstance(value, float) and not math.isfinite(value):
        raise ApiError(400, f"'{name}' must be a finite number", name)
    if check is not None and not check(value):
        raise ApiError(400, f"'{name}' is out of range: {value!r}", name)
    return value


class Api:
    def __init__(self, core: GatewayCore, tokenizer, model_name: str, max_model_len: int):
        self.core, self.tokenizer, self.model_name, self.model_max_len = core, tokenizer, model_name, max_model_len
        self.metrics = GatewayMetrics(core)

    @property
    def max_model_len(self) -> int:
        """The model's limit, or less where a live worker's KV cache holds fewer tokens."""
        workers = self.core.registry.max_model_len()
        return min(self.model_max_len, workers) if workers else self.model_max_len

    def app(self) -> Starlette:
        routes = [Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                  Route("/v1/models", self.models), Route("/health", self.health), Route("/v1/workers", self.workers),
                  Route("/metrics", self.prometheus)]
        return Starlette(routes=routes, lifespan=self.lifespan)

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        self.core.start()
        try:
            yield
        finally:
            await self.core.stop()

    # -- simple routes -------------------------------------------------------------------------------------
    async def models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                          "owned_by": "kvferry", "max_model_len": self.max_model_len}]})

    async def health(self, request: Request) -> JSONResponse:
        missing = self.core.missing()
        if missing:
            return JSONResponse({"status": "unavailable", "reason": missing}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def workers(self, request: Request) -> JSONResponse:
        return JSONResponse({"workers": [w.as_json() for w in self.core.registry.workers.values()],
                             "gateway": {"protocol_errors": self.core.control.num_protocol_errors,
                                         "requests_in_flight": len(self.core.flights)}})

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # -- generation ----------------------------------------------------------------------------------------
    async def completions(self, request: Request):
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: Request):
        return await self._serve(request, chat=True)

    async def _serve(self, request: Request, chat: bool):
        arrived_at = time.time()
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"  # the one id, on every message and log line
        request_id_var.set(rid)
        ctx = self._trace_context(request.headers.get("traceparent"))
        headers = {"x-request-id": rid, "traceparent": tracing.format_traceparent(ctx)}
        trace = RequestTrace(self.metrics, rid, ctx, request.url.path, arrived_at)
        try:
            body = await self._json(request)
            prompt_ids = self._prompt(body, chat)
            params, stop, stream, include_usage = self._params(body, chat, len(prompt_ids))
            trace.admitted(len(prompt_ids))
            events = self.core.generate(prompt_ids, params, rid, ctx)
            first = await events.__anext__()  # routing errors surface here, before any byte is sent
        except ApiError as exc:
            trace.finish(exc.status, error=exc.message)
            return exc.response(headers)
        except NoWorkers as exc:
            error = ApiError(503, f"no workers to serve the request: {exc}", kind="service_unavailable")
            trace.finish(503, error=error.message)
            return error.response(headers)
        shaper = ChatShape(rid, self.model_name) if chat else CompletionShape(rid, self.model_name)
        text = IncrementalText(self.tokenizer, stop)
        if stream:
            return StreamingResponse(self._stream(events, first, text, shaper, trace, include_usage),
                                     media_type="text/event-stream", headers=headers)
        return await self._whole(events, first, text, shaper, trace, headers)

    def _trace_context(self, traceparent: str | None):
        """The request's own span: a child of the client's traceparent, or the root of a new trace."""
        parent = tracing.parse_traceparent(traceparent)
        if traceparent is not None and parent is None:
            log.warning("ignoring a malformed traceparent header %r; starting a new trace", traceparent[:100])
        return tracing.child_of(parent)

    async def _json(self, request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise ApiError(404, f"the model '{model}' does not exist; this server serves '{self.model_name}'",
                           "model", "model_not_found", kind="not_found_error")
        return body

    def _prompt(self, body: dict, chat: bool) -> list[int]:
        if chat:
            messages = body.get("messages")
            if isinstance(messages, list):
                messages = [dict(m, content=text_of(m.get("content"))) if isinstance(m, dict) else m for m in messages]
            if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages):
                raise ApiError(400, "'messages' must be a non-empty list of {role, content} with text content",
                               "messages")
            try:
                ids = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                         return_dict=False)
            except Exception as exc:  # a template that rejects the conversation
                raise ApiError(400, f"the chat template rejected the messages: {exc}", "messages") from None
            ids = list(ids)
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]  # a batch of one
            if isinstance(prompt, str):
                ids = self.tokenizer.encode(prompt)
            elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                ids = list(prompt)
                bad = next((t for t in ids if not 0 <= t < len(self.tokenizer)), None)
                if bad is not None:
                    raise ApiError(400, f"token id {bad} is outside the vocabulary", "prompt")
            else:
                raise ApiError(400, "'prompt' must be a string or a list of token ids", "prompt")
        if not ids:
            raise ApiError(400, "the prompt is empty", "prompt" if not chat else "messages")
        return ids

    def _params(self, body: dict, chat: bool, num_prompt: int):
        room = self.max_model_len - num_prompt
        name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _field(body, name, (int,), None, lambda v: v >= 1, "a positive integer")
        if max_tokens is None:
            max_tokens = room if chat else 16
        if num_prompt + max_tokens > self.max_model_len:
            raise ApiError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                                f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the prompt, "
                                f"{max_tokens} for the completion).", "max_tokens", "context_length_exceeded")
        stop = body.get("stop")
        stop = [stop] if isinstance(stop, str) else stop
        if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
            raise ApiError(400, "'stop' must be a string or a list of strings", "stop")
        if stop is not None and len(stop) > MAX_STOP_STRINGS:
            raise ApiError(400, f"at most {MAX_STOP_STRINGS} stop strings", "stop")
        if _field(body, "n", (int,), 1) != 1:
            raise ApiError(400, "only n=1 is supported", "n")
        # Refused, never silently ignored: a client that asked for them would read a wrong answer.
        for name, neutral in NOT_YET_SUPPORTED.items():
            if body.get(name) not in (None, neutral):
                raise ApiError(400, f"'{name}' is not supported yet", name)
        stream = _field(body, "stream", (bool,), False)
        options = _field(body, "stream_options", (dict,), {}) or {}
        try:
            params = SamplingParams(
                max_tokens=max_tokens, temperature=_field(body, "temperature", (int, float), 1.0),
                top_p=_field(body, "top_p", (int, float), 1.0), top_k=_field(body, "top_k", (int,), 0),
                seed=_field(body, "seed", (int,), None), ignore_eos=_field(body, "ignore_eos", (bool,), False))
        except InvalidRequest as exc:
            raise ApiError(400, str(exc), str(exc).split(" ")[0]) from None
        return params, stop or [], stream, bool(options.get("include_usage"))

    def _next_text(self, event, text, trace) -> tuple[str, str | None]:
        """An event's text delta and the finish reason it brings (None: more to come)."""
        trace.tokens(event)
        started = time.time()
        delta = text.add(event.token_ids)
        reason = "stop" if text.stopped else finish_name(event.finish_reason)
        if reason:
            delta += text.flush()
        trace.detokenized(started, len(event.token_ids))
        return delta, reason

    async def _whole(self, events, first, text, shaper, trace, headers):
        event, pieces, kv_transfer_s, reason = first, [], 0.0, None
        try:
            while True:
                if event.error:
                    trace.finish(event.error_code, error=event.error)
                    return ApiError(event.error_code, event.error, kind="server_error").response(headers)
                kv_transfer_s = max(kv_transfer_s, event.kv_transfer_s)
                delta, reason = self._next_text(event, text, trace)
                pieces.append(delta)
                if reason:
                    break
                event = await events.__anext__()
        finally:
            await events.aclose()
            if reason is None:
                trace.finish(499)  # the client left (after an error this does nothing): counted as an abort
        whole = shaper.whole("".join(pieces), reason, usage(trace.num_prompt, trace.num_out))
        whole["kvferry"] = {"kv_transfer_s": round(kv_transfer_s, 6)}
        trace.finish(200, reason)
        return JSONResponse(whole, headers=headers)

    async def _stream(self, events, first, text, shaper, trace, include_usage):
        event, kv_transfer_s = first, 0.0
        try:
            yield sse(shaper.chunk("", None, first_chunk=True)) if shaper.has_role_chunk else b""
            while True:
                if event.error:
                    yield sse({"error": {"message": event.error, "type": "server_error", "param": None,
                                         "code": event.error_code}})
                    trace.finish(event.error_code, error=event.error)
                    break
                delta, reason = self._next_text(event, text, trace)
                kv_transfer_s = max(kv_transfer_s, event.kv_transfer_s)
                # One chunk per token event, even when the text is held back: clients time tokens by chunks.
                chunk = shaper.chunk(delta, reason)
                if reason:
                    chunk["kvferry"] = {"kv_transfer_s": round(kv_transfer_s, 6)}
                yield sse(chunk)
                if reason:
                    if include_usage:
                        yield sse(shaper.usage_chunk(usage(trace.num_prompt, trace.num_out)))
                    trace.finish(200, reason)
                    break
                event = await events.__anext__()
            yield b"data: [DONE]\n\n"
        finally:
            await events.aclose()  # a client gone mid-stream aborts the request on its workers
            trace.finish(499)  # a client gone mid-stream (else this does nothing): counted as an abort


def text_of(content):
    """Chat content as text: a string, or the text parts of a list of content parts."""
    if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text"
                                         and isinstance(part.get("text"), str) for part in content):
        return "".join(part["text"] for part in content)
    return content


def finish_name(reason: FinishReason | None) -> str | None:
    return None if reason is None else FINISH_NAMES[reason]  # STOP is 0: test for None, not truth


def sse(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def usage(num_prompt: int, num_out: int) -> dict:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_out, "total_tokens": num_prompt + num_out}


class CompletionShape:
    has_role_chunk = False

    def __init__(self, rid: str, model: str):
        self.base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model}

    def whole(self, text, reason, use):
        return {**self.base, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}],
                "usage": use}

    def chunk(self, delta, reason, first_chunk=False):
        return {**self.base, "choices": [{"index": 0, "text": delta, "logprobs": None, "finish_reason": reason}]}

    def usage_chunk(self, use):
        return {**self.base, "choices": [], "usage": use}


class ChatShape(CompletionShape):
    has_role_chunk = True

    def __init__(self, rid: str, model: str):
        self.base = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model}

    def whole(self, text, reason, use):
        return {**self.base, "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                          "logprobs": None, "finish_reason": reason}], "usage": use}

    def chunk(self, delta, reason, first_chunk=False):
        piece = {"role": "assistant", "content": ""} if first_chunk else ({"content": delta} if delta else {})
        return {**self.base, "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": piece, "logprobs": None, "finish_reason": reason}]}

    def usage_chunk(self, use):
        return {**self.base, "object": "chat.completion.chunk", "choices": [], "usage": use}
