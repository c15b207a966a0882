"""Turning a request's worker events into its choices: text with stop strings, logprobs, finish reasons.

One ChoiceState per choice (`n`). Each event for a choice yields that choice's delta: the new text
(held back at a partial character or a possible stop string), its logprobs part, and the finish
reason when the choice ends. With echo the prompt comes first; with max_tokens 0 (prompt_only)
the one token the workers generate is dropped and only the prompt is returned.
"""

from dataclasses import dataclass, field

from kvferry.services.gateway.detokenizer import IncrementalText
from kvferry.services.gateway.request_parsing import Generation
from kvferry.services.gateway.responses import ChatLogprobs, CompletionLogprobs, TokenText, finish_name


@dataclass
class Delta:
    text: str
    reason: str | None
    logprobs: dict | None
    stopped: bool = False  # by a stop string here, while the workers would go on


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
            )
            for p, g in enumerate(generations)
            for c in range(g.n)
        ]
        self.prompt_logprobs: dict[int, list] = {}  # per prompt (id of its Generation): sent with its choice 0
        self.echoed: dict[int, str] = {}  # per prompt: its text, decoded once for all its choices
        self.flight_ids: list[str] = []  # per prompt: the id its flight carries on the wire

    def flight_of(self, index: int) -> tuple[str, int]:
        """Choice index -> (its prompt's flight id, the choice's number within that flight)."""
        n = self.generation.n
        return self.flight_ids[index // n], index % n

    @property
    def done(self) -> bool:
        return all(s.reason is not None for s in self.states)

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
        g = state.generation
        text, parts, stopped = "", [], False
        first = event.first_token
        if first is not None and first.prompt_logprobs:
            self.prompt_logprobs[id(g)] = first.prompt_logprobs
        if g.echo and not state.started:
            if id(g) not in self.echoed:
                self.echoed[id(g)] = self.tokenizer.decode(g.prompt_ids, skip_special_tokens=True)
            text = self.echoed[id(g)]
            if state.logprobs is not None:
                prompt_logprobs = self.prompt_logprobs.get(id(g))
                parts.append(
                    state.logprobs.part(
                        [None, *prompt_logprobs[1:]] if prompt_logprobs else [None] * len(g.prompt_ids), g.prompt_ids
                    )
                )
        state.started = True
        if g.prompt_only:
            state.reason = "length"
        else:
            token_ids = event.token_ids
            state.num_out += len(token_ids)
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
        return Delta(text, state.reason, logprobs, stopped)

    def whole(self, shape) -> list[dict]:
        return [
            shape.choice(
                s.index,
                "".join(s.pieces),
                s.reason,
                s.logprobs.join(s.logprob_parts) if s.logprobs is not None else None,
            )
            for s in self.states
        ]
