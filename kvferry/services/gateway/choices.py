"""A request's worker events into its choices: each event yields its choice's delta (the new text, held back at a
partial character or a possible stop string; its logprobs; the finish reason at the end). With echo the prompt comes
first; with max_tokens 0 (prompt_only) the one generated token is dropped. A chat that may call tools has its text read
for calls (tool_calls.py), as it streams or whole, and finishes "tool_calls" where it would have finished "stop".
A choice whose constraint reached a dead end finishes "error".
"""

from dataclasses import dataclass, field

from kvferry.services.gateway.detokenizer import IncrementalText
from kvferry.services.gateway.request_parsing import Generation
from kvferry.services.gateway.responses import DEAD_END_ERROR, ChatLogprobs, CompletionLogprobs, TokenText, finish_name
from kvferry.services.gateway.tool_calls import ToolCallParser, delta_pieces, parse_tool_calls


@dataclass
class Delta:
    text: str
    reason: str | None
    logprobs: dict | None
    stopped: bool = False  # by a stop string here, while the workers would go on
    pieces: list[dict] | None = None  # a streamed chat with tools: its content and tool-call deltas, in order
    error: dict | None = None  # with reason "error"
    token_ids: list[int] = field(default_factory=list)  # this event's tokens that the choice kept


@dataclass
class ChoiceState:
    index: int
    generation: Generation  # its prompt's: a completions request may carry several prompts
    text: IncrementalText
    logprobs: CompletionLogprobs | ChatLogprobs | None
    num_out: int = 0
    reason: str | None = None
    pieces: list[str] = field(default_factory=list)
    logprob_parts: list[dict] = field(default_factory=list)
    started: bool = False  # the echoed prompt has been emitted
    tool_calls: ToolCallParser | None = None  # a streamed chat with tools
    error: dict | None = None
    token_ids: list[int] = field(default_factory=list)  # with return_token_ids: the output's, as generated


class Choices:
    """All choices of a request: prompt p's choice c has index p * n + c, as in OpenAI's and vLLM's responses."""

    def __init__(self, generations: list[Generation], tokenizer, token_text: TokenText, chat: bool):
        self.generation, self.tokenizer = generations[0], tokenizer  # what the prompts share
        builder = ChatLogprobs if chat else CompletionLogprobs
        self.states = [
            ChoiceState(
                p * g.n + c,
                g,
                IncrementalText(tokenizer, g.stop),
                builder(token_text) if g.logprobs is not None else None,
                tool_calls=ToolCallParser() if g.tool_calls and g.stream else None,
            )
            for p, g in enumerate(generations)
            for c in range(g.n)
        ]
        # Per prompt (the id of its Generation), built once for all its n choices: its logprobs (sent with choice 0's
        # first token), its text, and its logprobs part with the text offset after it.
        self.prompt_logprobs: dict[int, list] = {}
        self.echoed: dict[int, str] = {}
        self.echoed_logprobs: dict[int, tuple[dict, int]] = {}
        self.flight_ids: list[str] = []  # per prompt: the id its flight carries on the wire
        self.num_finished = 0  # choices with a finish reason: done is asked after every event

    def flight_of(self, index: int) -> tuple[str, int]:
        """Choice index -> (its prompt's flight id, the choice's number within that flight)."""
        n = self.generation.n
        return self.flight_ids[index // n], index % n

    @property
    def done(self) -> bool:
        return self.num_finished == len(self.states)

    @property
    def reasons(self) -> str:
        """Each choice's finish reason, in order, comma-joined (as the request's span and metrics take them)."""
        return ",".join(s.reason or "abort" for s in self.states)

    @property
    def num_out(self) -> int:
        return sum(s.num_out for s in self.states)

    def apply(self, event) -> Delta:
        """One event's delta for its choice (event.choice)."""
        state = self.states[event.choice]
        g, going = state.generation, state.reason is None
        text, parts, stopped = "", [], False
        first = event.first_token
        if first is not None and first.prompt_logprobs:
            self.prompt_logprobs[id(g)] = first.prompt_logprobs
        if g.echo and not state.started:
            if id(g) not in self.echoed:
                self.echoed[id(g)] = self.tokenizer.decode(g.prompt_ids, skip_special_tokens=True)
            text = self.echoed[id(g)]
            if state.logprobs is not None:
                parts.append(self._echoed_logprobs(state))
        state.started = True
        if g.prompt_only:
            state.reason = "length"
        else:
            token_ids = event.token_ids
            state.num_out += len(token_ids)
            if g.return_token_ids:
                state.token_ids.extend(token_ids)
            text += state.text.add(token_ids)
            reason = "stop" if state.text.stopped else finish_name(event.finish_reason)
            if reason:
                text += state.text.flush()
                # The flush may end in a stop string: one that ends in the partial character held back till now.
                state.reason = "stop" if state.text.stopped else reason
                stopped = state.text.stopped and event.finish_reason is None
            if state.logprobs is not None and event.logprobs:
                parts.append(state.logprobs.part(event.logprobs, token_ids))
        logprobs = state.logprobs.join(parts) if parts else None
        state.pieces.append(text)
        if logprobs:
            state.logprob_parts.append(logprobs)
        if state.reason == "error":
            state.error = DEAD_END_ERROR
        pieces = None
        if state.tool_calls is not None:
            parser = state.tool_calls
            pieces = delta_pieces(parser.feed(text) + (parser.finish() if state.reason else []))
            if state.reason == "stop" and parser.num_complete:
                state.reason = "tool_calls"
        self.num_finished += going and state.reason is not None
        kept = event.token_ids if g.return_token_ids and not g.prompt_only else []
        return Delta(text, state.reason, logprobs, stopped, pieces, state.error, kept)

    def _echoed_logprobs(self, state: ChoiceState) -> dict:
        """The logprobs part of the choice's echoed prompt: its prompt's, shared (completions: echo is theirs)."""
        g = state.generation
        built = self.echoed_logprobs.get(id(g))
        if built is not None:
            part, state.logprobs.offset = built
            return part
        prompt_logprobs = self.prompt_logprobs.get(id(g))
        entries = [None, *prompt_logprobs[1:]] if prompt_logprobs else [None] * len(g.prompt_ids)
        part = state.logprobs.part(entries, g.prompt_ids)
        if prompt_logprobs:  # else they may come yet, with choice 0's first token
            self.echoed_logprobs[id(g)] = part, state.logprobs.offset
        return part

    def num_echo_entries(self, index: int) -> int:
        """The logprob entries the choice's echoed prompt shows with its next event (0 once shown, or without)."""
        s = self.states[index]
        g = s.generation
        return len(g.prompt_ids) * (1 + g.logprobs) if g.echo and s.logprobs is not None and not s.started else 0

    @property
    def num_entries(self) -> int:
        """About how many values the whole response holds: each token shown, times 1 + logprobs with them."""
        total = 0
        for s in self.states:
            g = s.generation
            shown = s.num_out + (len(g.prompt_ids) if g.echo else 0)
            total += shown * (1 + (g.logprobs or 0))
        return total

    def whole(self, shape) -> list[dict]:
        out = []
        for s in self.states:
            text, calls = "".join(s.pieces), None
            if s.generation.tool_calls:
                text, found = parse_tool_calls(text)
                calls = [call.as_json() for call in found]
                if calls and s.reason == "stop":
                    s.reason = "tool_calls"
            logprobs = s.logprobs.join(s.logprob_parts) if s.logprobs is not None else None
            out.append(shape.choice(s.index, text, s.reason, logprobs, tool_calls=calls, error=s.error))
            if s.generation.return_token_ids:
                out[-1]["token_ids"] = s.token_ids
        return out
