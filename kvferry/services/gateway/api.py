"""The OpenAI-compatible HTTP API (Starlette): completions, chat completions, models, tokenizer, health, workers,
metrics and the OpenAPI description.

What a client sends is bounded before it costs anything (json_body.py, --max-prompt-chars before tokenizing, at most
max(--max-n, --max-prompts) choices). Parsing and tokenizing run on threads of their own, so that a large prompt never
holds up the event loop; a client that disconnects ends its request on every worker.
"""

import asyncio
import contextlib
import contextvars
import functools
import logging
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvferry.common import tracing
from kvferry.common.constraint import MAX_CONSTRAINT_BYTES
from kvferry.common.gateway_config import GatewayConfig
from kvferry.common.logs import request_id_var
from kvferry.common.protocol import MessageTooLarge
from kvferry.common.work_budget import RequestWork, WorkBudget, WorkCancelled, current_request
from kvferry.services.gateway import fanout, loop_lag
from kvferry.services.gateway.admission import Admission, body_bytes
from kvferry.services.gateway.api_error import ApiError, error_response
from kvferry.services.gateway.capture import CaptureWriter
from kvferry.services.gateway.choices import Choices
from kvferry.services.gateway.constraints import FIELDS as CONSTRAINT_FIELDS
from kvferry.services.gateway.constraints import request_constraint
from kvferry.services.gateway.guards import Guards
from kvferry.services.gateway.json_body import parse_json_body
from kvferry.services.gateway.metrics import GatewayMetrics
from kvferry.services.gateway.openapi import openapi_spec
from kvferry.services.gateway.request_parsing import Generation, check_fields, parse_generations
from kvferry.services.gateway.request_trace import RequestTrace
from kvferry.services.gateway.response_consumer import ResponseConsumer
from kvferry.services.gateway.response_size import check_response_size
from kvferry.services.gateway.responses import ChatShape, CompletionShape, TokenText
from kvferry.services.gateway.server import GatewayCore, NoWorkers
from kvferry.services.gateway.token_bytes import token_bytes
from kvferry.services.gateway.tokenizer_routes import TokenizerRoutes
from kvferry.services.gateway.tool_prompt import ToolPrompt
from kvferry.services.gateway.tools import Tools, parse_tools

log = logging.getLogger("kvferry.gateway")
VERSION = "0.1.0"
# Parsing bodies and tokenizing prompts: a few threads, as each encode is one core's work.
TEXT_THREADS = 4
# A schema's or tools' checks (up to their work budget, common/work_budget.py): threads of their own, so that a few
# large ones hold up only each other, never every other request's parsing and tokenizing.
CHECK_THREADS = 2
# All of a request's checks together: as many steps as the largest schema's own, twice over (the tools' schemas
# together, and a response_format beside them, are each within MAX_CONSTRAINT_BYTES).
REQUEST_CHECK_STEPS = 2 * WorkBudget(MAX_CONSTRAINT_BYTES).num_steps
CHECKED_FIELDS = ("tools", *CONSTRAINT_FIELDS)  # a body with any of them has its output rules checked on those threads
MAX_SHOWN_NAME = 100  # an unknown model's name, as a 404 repeats it: its first characters


class Api:
    def __init__(
        self,
        core: GatewayCore,
        tokenizer,
        model_names: str | Sequence[str],
        max_model_len: int,
        config: GatewayConfig | None = None,
        tool_prompt: ToolPrompt | None = None,
        capture: CaptureWriter | None = None,
        loaded_at: float | None = None,
        gateway_index: int | None = None,
    ):
        """model_names: the names a request may give (--served-model-name), the first the one responses report;
        loaded_at: when the model's files were loaded (Unix time; default now), /v1/models' created; gateway_index:
        this process's among several behind one port (--gateways), else None."""
        self.core, self.tokenizer, self.model_max_len = core, tokenizer, max_model_len
        self.model_names = (model_names,) if isinstance(model_names, str) else tuple(model_names)
        self.model_name = self.model_names[0]
        self.created = int(time.time() if loaded_at is None else loaded_at)
        self.config = config = config or GatewayConfig()
        self.tool_prompt = tool_prompt or ToolPrompt()  # tools shown to a model whose chat template has none
        self.capture = capture  # with --capture-dir: every finished request's line
        self.admission = Admission(config.max_waiting, config.max_waiting_bytes)
        self.metrics = GatewayMetrics(core, gateway_index)
        self.token_text = TokenText(tokenizer)
        token_bytes(tokenizer)  # worked out now (a fraction of a second), not in the first request's turn of the loop
        self.vocab_size = len(tokenizer)
        self.tokenizer_routes = TokenizerRoutes(self, tokenizer)
        self.text_threads = ThreadPoolExecutor(TEXT_THREADS, thread_name_prefix="kvferry-text")
        self.check_threads = ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="kvferry-check")
        self.running_checks: set[RequestWork] = set()  # of the requests whose content is being checked off the loop

    @property
    def max_model_len(self) -> int:
        """The model's limit, or less where a live worker's KV cache holds fewer tokens."""
        workers = self.core.registry.max_model_len()
        return min(self.model_max_len, workers) if workers else self.model_max_len

    def routes(self) -> list[Route]:
        t = self.tokenizer_routes
        return [
            Route("/v1/completions", functools.partial(self._serve, chat=False), methods=["POST"], name="completions"),
            Route(
                "/v1/chat/completions",
                functools.partial(self._serve, chat=True),
                methods=["POST"],
                name="chat_completions",
            ),
            Route("/v1/models", self.models, methods=["GET"]),
            # Let in as a generation is (admitted): they parse a body too.
            Route("/tokenize", functools.partial(self.admitted, handler=t.tokenize), methods=["POST"], name="tokenize"),
            Route(
                "/detokenize",
                functools.partial(self.admitted, handler=t.detokenize),
                methods=["POST"],
                name="detokenize",
            ),
            Route("/tokenizer_info", t.tokenizer_info, methods=["GET"]),
            Route("/version", self.version, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/workers", self.workers, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
            Route("/openapi.json", self.openapi, methods=["GET"]),
        ]

    def app(self) -> Starlette:
        routes = self.routes()
        json_paths = frozenset(route.path for route in routes if "POST" in route.methods)  # every POST takes JSON
        guards = Middleware(
            Guards,
            api_key=self.config.api_key,
            max_body_bytes=self.config.max_body_size,
            json_paths=json_paths,
            admission=self.admission,
        )
        return Starlette(
            routes=routes,
            middleware=[guards],
            lifespan=self.lifespan,
            exception_handlers={404: self._not_found, 405: self._not_allowed},
        )

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        self.core.start()
        lag_watch = loop_lag.start_watch(self.metrics.loop_lag)
        try:
            yield
        finally:
            await loop_lag.stop_watch(lag_watch)
            for work in list(self.running_checks):  # a check still running stops at its next look: the process can exit
                work.cancel()
            await self.core.stop()
            if self.capture is not None:
                await asyncio.get_running_loop().run_in_executor(None, self.capture.close)

    async def _not_found(self, request, exc):
        return error_response(ApiError(404, f"no route {request.url.path}", kind="not_found_error"))

    async def _not_allowed(self, request, exc):
        return error_response(ApiError(405, f"{request.method} is not allowed on {request.url.path}"))

    # -- simple routes -------------------------------------------------------------------------------------
    async def models(self, request: Request) -> JSONResponse:
        """The one model under each of its names, as vLLM lists them; created: when the gateway loaded it."""
        card = {"object": "model", "created": self.created, "owned_by": "kvferry", "max_model_len": self.max_model_len}
        return JSONResponse({"object": "list", "data": [{"id": name, **card} for name in self.model_names]})

    async def version(self, request: Request) -> JSONResponse:
        return JSONResponse({"version": VERSION})

    async def health(self, request: Request) -> JSONResponse:
        if self.core.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        missing = self.core.missing()
        if missing:
            return JSONResponse({"status": "unavailable", "reason": missing}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def workers(self, request: Request) -> JSONResponse:
        core = self.core
        # A worker's requests in flight are those that still depend on it: a prefill worker's end when their KV lands.
        on = lambda w: sum(f.involves(w.identity) for f in core.flights.values())
        return JSONResponse(
            {
                "workers": [{**w.as_json(), "requests_in_flight": on(w)} for w in core.registry.workers.values()],
                "gateway": {
                    "id": core.gateway_id,
                    "protocol_errors": core.control.num_protocol_errors,
                    "duplicates_dropped": core.control.num_duplicates,
                    "forged_dropped": core.num_forged,
                    "requests_in_flight": len(core.flights),
                    "requests_waiting": core.num_waiting(),
                    "moves": core.num_moves,
                    "draining": core.draining,
                },
            }
        )

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def openapi(self, request: Request) -> JSONResponse:
        return JSONResponse(openapi_spec(VERSION, self.config))

    # -- generation ----------------------------------------------------------------------------------------
    async def _serve(self, request: Request, chat: bool):
        arrived_at, arrived_monotonic = time.time(), time.monotonic()
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"  # the one id, on every message and log line
        request_id_var.set(rid)
        ctx = self._trace_context(request.headers.get("traceparent"))
        headers = {"x-request-id": rid, "traceparent": tracing.format_traceparent(ctx)}
        path = request.url.path
        capture = self.capture.request(rid, ctx.trace_id, self.model_name, path, arrived_at) if self.capture else None
        trace = RequestTrace(self.metrics, rid, ctx, path, arrived_at, capture)
        try:
            if self.core.draining:
                raise ApiError(503, "the server is shutting down", kind="service_unavailable")
            num_bytes = body_bytes(request)
            with self.admission.let_in(num_bytes):  # until its first event
                if capture is not None:
                    capture.num_body_bytes = num_bytes
                response = await self._start(
                    request, chat, rid, ctx, arrived_monotonic + self.core.deadlines.request_s, trace
                )
        except (ApiError, NoWorkers, MessageTooLarge) as exc:
            error = _refusal(exc)
            trace.finish(error.status, error=error.message)
            return error_response(error, headers)
        except ClientDisconnect:  # the client left: whatever it had started ended on every worker
            trace.finish(499)
            return Response(status_code=499)  # nobody reads it
        return await response.respond(request, headers)

    async def _start(self, request: Request, chat: bool, rid: str, ctx, deadline: float, trace: RequestTrace):
        """Parse and route the request: its ResponseConsumer, holding its first event (a routing error surfaces
        with it, before any byte is sent)."""
        body = await self.json_body(request)
        capture = trace.capture
        if capture is not None:
            capture.record.body = body
        checked = any(body.get(name) is not None for name in CHECKED_FIELDS)
        tools, constraint = await self.checks_off_loop(request, deadline, self.output_rules, body, chat, checks=checked)
        prompts = await self.checks_off_loop(request, deadline, self.prompt_ids, body, chat, tools)
        calls = tools is not None and tools.calls_allowed
        generations = parse_generations(
            body, chat, prompts, self.max_model_len, self.vocab_size, self.config, constraint, tool_calls=calls
        )
        n, most = generations[0].n, max(self.config.max_n, self.config.max_prompts)
        if len(prompts) * n > most:  # each choice is a sequence on a decode worker: --max-n or --max-prompts, not both
            raise ApiError(
                400,
                f"{len(prompts)} prompts with n={n} make {len(prompts) * n} choices; at most {most} per request",
                "n",
            )
        check_response_size(generations, chat, body, self.config)
        shape = ChatShape(rid, self.model_name) if chat else CompletionShape(rid, self.model_name)
        choices = Choices(generations, self.tokenizer, self.token_text, chat)
        choices.flight_ids = [rid] if len(prompts) == 1 else [f"{rid}/p{p}" for p in range(len(prompts))]
        flights = capture.flights if capture is not None else None
        events, first = await self._unless_client_leaves(request, self._route(prompts, generations, rid, ctx, flights))
        response = ResponseConsumer(self, events, first, choices, shape, trace)
        await response.check_first()
        trace.admitted(sum(len(ids) for ids in prompts), n, constraint.kind if constraint else "")
        if capture is not None:
            capture.record.prompt_token_ids = prompts
            capture.choices = choices
        return response

    async def _route(self, prompts: list[list[int]], generations: list[Generation], rid: str, ctx, flights=None):
        """Route every prompt: the request's event lists, and the first of them. flights: a list that gets each
        prompt's Flight, for the capture."""
        if len(prompts) == 1:
            events = self.core.generate_batches(prompts[0], generations[0].params, rid, ctx, generations[0].n, flights)
        else:  # one flight per prompt, its id the request's with /p<prompt> (kvferry trace groups them)
            streams = [
                self.core.generate_batches(ids, g.params, f"{rid}/p{p}", ctx, g.n, flights)
                for p, (ids, g) in enumerate(zip(prompts, generations))
            ]
            events = fanout.merged(streams, await fanout.start(streams), generations[0].n)
        return events, await events.__anext__()

    async def admitted(self, request: Request, handler):
        """handler(request)'s response, the request let in (and held until it answers) as a generation is."""
        try:
            with self.admission.let_in(body_bytes(request)):
                return await handler(request)
        except ApiError as exc:
            return error_response(exc)
        except ClientDisconnect:
            return JSONResponse({}, status_code=499)  # nobody reads it

    async def off_loop(self, fn, *args, checks: bool = False):
        """fn(*args) on a text thread (checks: a check thread), in the request's context (its id on every log
        line)."""
        run = functools.partial(contextvars.copy_context().run, fn, *args)
        threads = self.check_threads if checks else self.text_threads
        return await asyncio.get_running_loop().run_in_executor(threads, run)

    async def checks_off_loop(self, request: Request, deadline: float, fn, *args, checks: bool = False):
        """off_loop(fn, *args) under the request's work budget (common/work_budget.py), which stops it at its next look
        once nobody wants the answer: the client left (ClientDisconnect), the deadline passed (504), the gateway stops
        (503)."""
        work = RequestWork(deadline, REQUEST_CHECK_STEPS)
        token = current_request.set(work)  # the task below, and so the thread, run in a copy of this context
        self.running_checks.add(work)
        try:
            return await self._unless_client_leaves(request, self.off_loop(fn, *args, checks=checks))
        except WorkCancelled:
            if work.deadline is not None and time.monotonic() >= work.deadline:
                raise ApiError(504, "the request took longer than its deadline", kind="timeout_error") from None
            raise ApiError(503, "the server is shutting down", kind="service_unavailable") from None
        finally:
            current_request.reset(token)
            work.cancel()  # what still runs was abandoned: the client left
            self.running_checks.discard(work)

    @staticmethod
    async def _unless_client_leaves(request: Request, work):
        """The result of the coroutine work; if the client disconnects first, work is cancelled, its clean-up
        awaited, and ClientDisconnect raised."""
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(client_disconnects(request.receive))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            task.cancel()
            await asyncio.wait({task})  # its clean-up too: the Aborts to the workers
        if task.cancelled():
            raise ClientDisconnect
        return task.result()

    def _trace_context(self, traceparent: str | None):
        """The request's own span: a child of the client's traceparent, or the root of a new trace."""
        parent = tracing.parse_traceparent(traceparent)
        if traceparent is not None and parent is None:
            log.warning("ignoring a malformed traceparent header %r; starting a new trace", traceparent[:100])
        return tracing.child_of(parent)

    async def json_body(self, request: Request) -> dict:
        body = await self.off_loop(parse_json_body, await request.body())  # ClientDisconnect if the client left
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise ApiError(400, "'model' must be a string", "model")
        if model is not None and model not in self.model_names:
            served = " or ".join(f"'{name}'" for name in self.model_names)
            shown = model if len(model) <= MAX_SHOWN_NAME else model[:MAX_SHOWN_NAME] + "..."
            raise ApiError(
                404,
                f"the model '{shown}' does not exist; this server serves {served}",
                "model",
                "model_not_found",
                kind="not_found_error",
            )
        return body

    @staticmethod
    def output_rules(body: dict, chat: bool):
        """(tools, constraint): the tools a chat may call and what its output must match (on a text thread: a
        schema's checks take a while)."""
        check_fields(body, chat)  # an unknown field first: it may be what was meant to constrain the output
        tools = parse_tools(body) if chat else None
        return tools, request_constraint(body, tools)

    def prompt_ids(self, body: dict, chat: bool, tools: Tools | None = None) -> list[list[int]]:
        """The request's prompts as token ids (on a text thread): chat has one; completions take a string, token ids,
        or a list of either (a batch)."""
        if chat:
            ids = self.tokenizer_routes.chat_ids(body.get("messages"), tools=tools)
            return [self._checked(ids, "messages")]
        prompt = body.get("prompt")
        is_ids = lambda x: isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
        if isinstance(prompt, str) or is_ids(prompt):
            batch = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or (is_ids(p) and p) for p in prompt):
            batch = prompt
        else:
            raise ApiError(
                400, "'prompt' must be a string, a list of token ids, or a non-empty list of either", "prompt"
            )
        if len(batch) > self.config.max_prompts:
            raise ApiError(400, f"at most {self.config.max_prompts} prompts per request", "prompt")
        self.tokenizer_routes.check_chars(sum(len(p) for p in batch if isinstance(p, str)), "prompt")
        encode = self.tokenizer.encode
        return [self._checked(encode(p) if isinstance(p, str) else list(p), "prompt") for p in batch]

    def _checked(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise ApiError(400, "the prompt is empty", param)
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is outside the vocabulary", param)
        return ids


def _refusal(exc: Exception) -> ApiError:
    """What the client reads of a request refused before its first byte."""
    if isinstance(exc, NoWorkers):
        return ApiError(503, f"no workers to serve the request: {exc}", kind="service_unavailable")
    if isinstance(exc, MessageTooLarge):  # past the wire's bound for its kind: refused before it reaches a worker
        param = exc.field.rsplit(".", 1)[-1].replace("prompt_token_ids", "prompt") or None
        return ApiError(400, f"the request is too large to send to a worker: {exc}", param)
    return exc


async def client_disconnects(receive) -> None:
    """Returns once the client has gone. The body was read already, so all that can come is http.disconnect."""
    while (await receive())["type"] != "http.disconnect":
        pass
