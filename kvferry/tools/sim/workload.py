"""What the simulator replays: a capture's requests as arrivals (by the wall clock, the one clock several gateways'
files share), prompt token ids (routing and prefix caching hash them) and each choice's output token ids, whose
count is the length generated (as with ignore_eos). A request not ok (status other than 200) or without prompt token
ids is counted, not replayed.
"""

import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kvferry.common import capture


@dataclass(frozen=True)
class RequestSpec:
    request_id: str
    arrival_s: float  # since the first replayed request's arrival, at the captured rate
    prompts: list[list[int]]  # one token id list per prompt: each is a flight of its own at the gateway
    outputs: list[list[list[int]]]  # per prompt, per choice: the output token ids the capture holds


@dataclass
class Workload:
    requests: list[RequestSpec]
    num_not_ok: int = 0  # status other than 200: failed or refused when captured
    num_without_prompt: int = 0  # no prompt token ids recorded
    num_malformed: int = 0  # lines that could not be read

    @property
    def num_gaps(self) -> int:
        """Inter-token gaps if every request is served: each choice's tokens but its first."""
        return sum(max(1, len(ids)) - 1 for r in self.requests for choices in r.outputs for ids in choices)


def from_records(records: Iterable[capture.Record], num_malformed: int = 0) -> Workload:
    workload = Workload([], num_malformed=num_malformed)
    start = None
    for record in sorted(records, key=lambda r: r.arrival_unix):
        if record.status != 200:
            workload.num_not_ok += 1
            continue
        prompts = [list(ids) for ids in record.prompt_token_ids if ids]
        if not prompts or len(prompts) != len(record.prompt_token_ids):
            workload.num_without_prompt += 1
            continue
        start = record.arrival_unix if start is None else start
        n = _choices_per_prompt(record, len(prompts))
        outputs = record.output_token_ids
        per_prompt = [
            [list(outputs[i * n + c]) if i * n + c < len(outputs) else [] for c in range(n)]
            for i in range(len(prompts))
        ]
        workload.requests.append(RequestSpec(record.request_id, record.arrival_unix - start, prompts, per_prompt))
    return workload


def _choices_per_prompt(record: capture.Record, num_prompts: int) -> int:
    """n from the body, or from the outputs when the body does not say (choice index = prompt * n + choice)."""
    n = record.body.get("n") if isinstance(record.body, dict) else None
    if isinstance(n, int) and not isinstance(n, bool) and n >= 1:
        return n
    return max(1, len(record.output_token_ids) // num_prompts)


def load(paths: Iterable[str | Path], warn=None) -> Workload:
    """The capture files' (or folders') requests in arrival order. Each unreadable line is named (FILE:LINE: why)
    through warn, by default on stderr, and skipped."""
    warn = warn or (lambda message: print(f"warning: {message}", file=sys.stderr))
    skipped: list[str] = []

    def on_skip(message: str) -> None:
        skipped.append(message)
        warn(f"{message}; skipped")

    return from_records(capture.load(paths, on_skip), num_malformed=len(skipped))
