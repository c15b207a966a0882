"""One request's events into its choices and the client's response: whole (one JSON body once every choice is done)
or streamed (server-sent events as they come), both through one loop (ResponseConsumer._deltas). A choice that ended
early (a stop string) is aborted on its worker while the others go on. However the response ends, what still runs is
aborted on its workers and the trace is finished once: 200, the worker's error, or 499 for a client that left.
"""

import functools
import re
import time

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvferry.services.gateway.api_error import ApiError, error_response
from kvferry.services.gateway.choices import Choices
from kvferry.services.gateway.request_trace import RequestTrace
from kvferry.services.gateway.responses import sse, usage

# A whole response with more values than this (tokens, times 1 + logprobs) is built and serialized on a text thread:
# a few milliseconds of the event loop's time, which every stream waits through.
OFF_LOOP_ENTRIES = 10_000
FIELD_NAME = re.compile(r"[\w.$\[\]-]{1,200}")  # how a worker's refusal names the request field it is about


def worker_error(event) -> ApiError:
    """A worker's error event as the client's error. A 4xx is a refusal of the request: a constraint that does not
    compile says "<field>: <reason>", and param names that field. Anything else is the server's."""
    if not 400 <= event.error_code < 500:
        return ApiError(event.error_code, event.error, kind="server_error")
    prefix = event.error.split(": ", 1)[0] if ": " in event.error else ""
    return ApiError(event.error_code, event.error, prefix if FIELD_NAME.fullmatch(prefix) else None)


class ResponseConsumer:
    def __init__(self, api, events, first: list, choices: Choices, shape, trace: RequestTrace):
        """api: what runs work off the loop (off_loop), aborts a choice (core.abort_choice) and waits unless the
        client leaves; events: the request's event lists (GatewayCore.generate_batches), first its first."""
        self.api, self.events, self.first = api, events, first
        self.choices, self.shape, self.trace = choices, shape, trace
        self.kv_transfer_s = 0.0  # the longest KV transfer among the choices

    async def check_first(self) -> None:
        """A refusal with the first event (a constraint that does not compile) is the HTTP status, for a stream
        too: raised as an ApiError, before any byte is sent."""
        first = self.first[0]
        if first.error is not None and 400 <= first.error_code < 500:
            await self.events.aclose()
            raise worker_error(first)

    async def respond(self, request: Request, headers: dict) -> Response:
        if self.choices.generation.stream:
            return StreamingResponse(self._stream(), media_type="text/event-stream", headers=headers)
        return await self._whole(request, headers)

    async def _deltas(self):
        """For each list of events, (event, its delta, whether it was heavy, the choices' tokens out after it) for
        those that went into a choice still going (an event of a choice that ended early, at a stop string, is
        dropped), until every choice is done; a worker's error raises its ApiError."""
        events, choices, trace, states = self.first, self.choices, self.trace, self.choices.states
        counted = choices.generation.continuous_usage  # else the tokens out are not asked for
        timed = trace.tracer.enabled  # detokenization spans
        # A long prompt's logprobs shown with its first event (echo) are built on a text thread: heavy.
        echoes = any(s.generation.echo and s.logprobs is not None for s in states)
        observed = not choices.generation.prompt_only
        while True:
            deltas = []
            for event in events:
                if event.error:
                    if deltas:  # what came before it goes out first
                        yield deltas
                    raise worker_error(event)
                decoded = event.decode_tokens  # a choice's first tokens from decode report their KV's transfer
                if decoded is not None and decoded.kv_transfer_s > self.kv_transfer_s:
                    self.kv_transfer_s = decoded.kv_transfer_s
                if states[event.choice].reason is not None:
                    continue
                if observed:
                    trace.tokens(event)
                started = time.time() if timed else 0.0
                heavy = echoes and choices.num_echo_entries(event.choice) > OFF_LOOP_ENTRIES
                delta = await self.api.off_loop(choices.apply, event) if heavy else choices.apply(event)
                if timed:
                    trace.detokenized(started, len(event.token_ids))
                if delta.stopped and not choices.done:  # the other choices go on: free this one's sequence now
                    await self.api.core.abort_choice(*choices.flight_of(event.choice))
                deltas.append((event, delta, heavy, choices.num_out if counted else 0))
                if choices.done:
                    break
            if deltas:
                yield deltas
            if choices.done:
                return
            events = await self.events.__anext__()

    async def _collect(self) -> None:
        try:
            async for _ in self._deltas():
                pass
        finally:
            await self.events.aclose()  # whatever still runs is aborted on its workers

    async def _whole(self, request: Request, headers: dict) -> Response:
        choices, trace = self.choices, self.trace
        try:
            await self.api._unless_client_leaves(request, self._collect())
        except ApiError as exc:  # a worker's error
            trace.finish(exc.status, error=exc.message)
            return error_response(exc, headers)
        except ClientDisconnect:  # its generation ended on every worker
            return Response(status_code=499)  # nobody reads it
        finally:
            if not choices.done:
                trace.finish(499)  # the client left (after an error this does nothing): counted as an abort
        use = usage(trace.num_prompt, choices.num_out)
        build = functools.partial(whole_response, choices, self.shape, use, self.kv_transfer_s, headers)
        response = await self.api.off_loop(build) if choices.num_entries > OFF_LOOP_ENTRIES else build()
        trace.finish(200, choices.reasons)
        return response

    async def _stream(self):
        choices, shape, trace, generation = self.choices, self.shape, self.trace, self.choices.generation
        # stream_options.continuous_usage_stats: every chunk carries the request's usage so far (vLLM's field)
        so_far = (lambda num_out: usage(trace.num_prompt, num_out)) if generation.continuous_usage else lambda _: None
        try:
            if shape.has_role_chunk:
                role = {"role": "assistant", "content": ""}
                first_chunks = [shape.delta_choice(s.index, "", None, None, piece=role) for s in choices.states]
                yield sse(shape.chunk(first_chunks, so_far(choices.num_out)))
            async for deltas in self._deltas():
                # At least one chunk per token event, even when the text is held back: clients time tokens by
                # chunks. A chat with tools sends one per content or tool-call piece. The events that came
                # together go out in one write.
                chunks, heavy = [], False
                for event, delta, was_heavy, num_out in deltas:
                    heavy |= was_heavy
                    use, with_ids = so_far(num_out), choices.states[event.choice].generation.return_token_ids
                    if use is None and not with_ids and is_text_alone(delta):  # most of a stream
                        chunks.append(shape.text_chunk(event.choice, delta.text))
                        continue
                    made = [shape.chunk([choice], use) for choice in shape.delta_choices(event.choice, delta)]
                    if with_ids:
                        made[0]["choices"][0]["token_ids"] = delta.token_ids
                    if choices.done and event is deltas[-1][0]:
                        made[-1]["kvferry"] = {"kv_transfer_s": round(self.kv_transfer_s, 6)}
                    chunks += made
                if heavy:  # a long echoed prompt's logprobs: serialized on a text thread
                    yield await self.api.off_loop(serialized, chunks)
                else:
                    yield chunks[0] if len(chunks) == 1 and type(chunks[0]) is bytes else serialized(chunks)
            if generation.include_usage:
                yield sse(shape.chunk([], usage(trace.num_prompt, choices.num_out)))
            trace.finish(200, choices.reasons)
        except ApiError as exc:  # a worker's error after the stream began: an event, then [DONE]
            error = exc.body()
            error["error"]["code"] = exc.status
            yield sse(error)
            trace.finish(exc.status, error=exc.message)
        finally:
            await self.events.aclose()  # a client gone mid-stream aborts the request on its workers
            trace.finish(499)  # a client gone mid-stream (else this does nothing): counted as an abort
        yield b"data: [DONE]\n\n"


def serialized(chunks: list) -> bytes:
    """Stream chunks (dicts, or bytes made already) as server-sent events."""
    return b"".join([chunk if type(chunk) is bytes else sse(chunk) for chunk in chunks])


def is_text_alone(delta) -> bool:
    """A delta of text alone (perhaps none): no finish reason, logprobs, error or tool-call pieces."""
    return delta.reason is None and delta.logprobs is None and delta.error is None and delta.pieces is None


def whole_response(choices: Choices, shape, use: dict, kv_transfer_s: float, headers: dict) -> JSONResponse:
    """A finished request's whole body, serialized (on a text thread when large: nothing changes its choices now)."""
    whole = shape.whole(choices.whole(shape), use)
    whole["kvferry"] = {"kv_transfer_s": round(kv_transfer_s, 6)}
    return JSONResponse(whole, headers=headers)
