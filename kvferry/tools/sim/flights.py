"""One simulated request's life, and the times the report reads: a flight per prompt, routed on its own (as the
gateway's Flight is), whose choices share its prefill and transfer, then decode as a sequence each.

    QUEUED ──start──▶ PREFILLING ──first_tokens──▶ SHIPPING ──admitted──▶ DECODING ──end──▶ DONE
                                      └────────── end (every choice ended at its first token) ──────▶ DONE
    end(error): refused at arrival, or a transfer no decode worker could take, from any state

The scheduler's sequences carry these records as their request ids (the real decode worker's are not strings
either), so a step's chunk leads to its flight or choice without a lookup.
"""

import enum
from dataclasses import dataclass, field

from kvferry.common.sequence import Sequence
from kvferry.tools.sim.workload import RequestSpec


class FlightState(enum.Enum):
    QUEUED = "queued"
    PREFILLING = "prefilling"
    SHIPPING = "shipping"  # first tokens out; its KV on the way, or waiting for room at the decode worker
    DECODING = "decoding"
    DONE = "done"


S = FlightState
ALLOWED = {
    S.QUEUED: (S.PREFILLING, S.DONE),
    S.PREFILLING: (S.SHIPPING, S.DONE),
    S.SHIPPING: (S.DECODING, S.DONE),
    S.DECODING: (S.DONE,),
    S.DONE: (),
}


@dataclass(eq=False, slots=True)
class SimChoice:
    flight: "SimFlight"
    output_token_ids: list[int]  # as captured: their count is the length generated
    last_token_at: float = 0.0
    gaps: list[float] = field(default_factory=list)  # between its tokens, in order
    finished_at: float | None = None
    seq: Sequence | None = None  # its decode sequence, once admitted

    @property
    def length(self) -> int:
        """Tokens it generates: a choice always has its first (a captured empty one ended there)."""
        return max(1, len(self.output_token_ids))

    def token_at(self, i: int) -> int:
        """Its i-th output token, to hand the scheduler as the sampled one (prefix caching hashes them)."""
        return self.output_token_ids[i] if i < len(self.output_token_ids) else 0


@dataclass(eq=False)
class SimFlight:
    request: "SimRequest"
    prompt_token_ids: list[int]
    block_hashes: list[bytes]
    choices: list[SimChoice] = field(default_factory=list)
    going_on: list[SimChoice] = field(default_factory=list)  # the choices that decode past their first token
    params: list = field(default_factory=list)  # and their SamplingParams at the decode worker
    state: FlightState = FlightState.QUEUED
    prefill: object = None  # the SimWorkers the registry picked
    decode: object = None
    pending_prompt_tokens: int = 0  # what the gateway counted against the prefill worker when it routed it
    prefill_seq: Sequence | None = None
    held: list[int] = field(default_factory=list)  # the decode worker's cached blocks held for the transfer
    blocks: list[int] = field(default_factory=list)  # allocated at the decode worker for the KV on the way
    started_at: float | None = None  # its first chunk scheduled
    first_token_at: float | None = None
    retry_from: float = 0.0  # when the decode worker last had no room: retries go every RETRY_FULL_AFTER_S from then
    num_open_choices: int = 0

    def start(self, now: float) -> None:
        self._move(S.PREFILLING)
        self.started_at = now

    def first_tokens(self, now: float, params: list, ends) -> list[SimChoice]:
        """Every choice has its first token; ends(choice, its params): whether that ends it. Returns the rest."""
        self._move(S.SHIPPING)
        self.first_token_at = now
        self.going_on, self.params = [], []
        for choice, choice_params in zip(self.choices, params):
            choice.last_token_at = now
            if ends(choice, choice_params):
                choice.finished_at = now
            else:
                self.going_on.append(choice)
                self.params.append(choice_params)
        self.num_open_choices = len(self.going_on)
        return self.going_on

    def admitted(self) -> None:
        self._move(S.DECODING)
        self.held, self.blocks = [], []  # their references went to the decode sequences

    def choice_finished(self, choice: SimChoice, now: float) -> bool:
        """True when it was the last choice."""
        choice.finished_at = now
        self.num_open_choices -= 1
        return self.num_open_choices == 0

    def end(self, now: float, error: str = "") -> None:
        self._move(S.DONE)
        self.request.flight_ended(now, error)

    def _move(self, to: FlightState) -> None:
        if to not in ALLOWED[self.state]:
            raise AssertionError(f"a simulated flight cannot go from {self.state.value} to {to.value}")
        self.state = to


@dataclass(eq=False)
class SimRequest:
    spec: RequestSpec
    arrival: float  # virtual seconds
    flights: list[SimFlight] = field(default_factory=list)
    error: str = ""  # refused at arrival, or a flight failed
    finished_at: float | None = None
    num_open_flights: int = 0

    def flight_ended(self, now: float, error: str) -> None:
        self.error = self.error or error
        self.num_open_flights -= 1
        if self.num_open_flights == 0:
            self.finished_at = now

    def refuse(self, now: float, error: str) -> None:
        self.error, self.finished_at = error, now

    # -- what the report reads -------------------------------------------------------------------------------
    @property
    def first_token_at(self) -> float | None:
        """The earliest first token of its prompts: the first event its client got."""
        return min((f.first_token_at for f in self.flights if f.first_token_at is not None), default=None)

    @property
    def ttft(self) -> float | None:
        first = self.first_token_at
        return None if first is None or self.error else first - self.arrival

    @property
    def queue(self) -> float | None:
        times = [f.started_at for f in self.flights if f.started_at is not None]
        return min(times) - self.arrival if times and not self.error else None

    @property
    def e2e(self) -> float | None:
        return None if self.finished_at is None or self.error else self.finished_at - self.arrival

    @property
    def gaps(self) -> list[float]:
        return [g for f in self.flights for c in f.choices for g in c.gaps]

    @property
    def num_preemptions(self) -> int:
        return sum(c.seq.num_preemptions for f in self.flights for c in f.choices if c.seq is not None)

    @property
    def num_output_tokens(self) -> int:
        return sum(1 + len(c.gaps) for f in self.flights for c in f.choices if f.first_token_at is not None)
