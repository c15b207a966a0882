"""Traffic capture (--capture-dir): one JSON line per finished request (common/capture.py has the format).

The event loop only gathers a request's figures into a Record; serializing, redacting and writing happen on one
writer thread, so a large body never holds up the loop. The queue to it is bounded in records and in bytes (a record
holds its whole body): past it, records are dropped and counted, never waited for. capture_files.py names, rotates
and deletes the files.
"""

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvferry.common.capture import Record, redact
from kvferry.services.gateway.capture_files import CaptureFiles, CaptureLimits

log = logging.getLogger("kvferry.gateway")
MAX_QUEUED_RECORDS = 1024  # finished requests waiting for the writer thread; past it they are dropped
MAX_QUEUED_BYTES = 16 * 2**20  # the same, by their bodies as sent and their outputs (a lone record always fits)


class CaptureWriter:
    """The gateway's capture: records come from the event loop, lines go out on the writer thread."""

    def __init__(
        self,
        folder: str | Path,
        owner: str,
        limits: CaptureLimits,
        secrets: tuple[str, ...] = (),
        max_queued_bytes: int = MAX_QUEUED_BYTES,
    ):
        self.files = CaptureFiles(folder, owner, limits)  # the folder is made now: a bad path fails at start
        self.secrets = tuple(s for s in secrets if s)
        self.queue: queue.Queue = queue.Queue(MAX_QUEUED_RECORDS)  # of (record, its bytes)
        self.max_queued_bytes = max_queued_bytes
        self.num_queued_bytes = 0  # taken on the event loop, given back on the writer thread: under the lock
        self.lock = threading.Lock()
        self.num_written = self.num_dropped = self.num_failed = 0
        self.thread = threading.Thread(target=self._write_loop, name="kvferry-capture", daemon=True)
        self.thread.start()

    def submit(self, record: Record, num_bytes: int = 0) -> None:
        """num_bytes: about what the record holds (its body as sent, its output)."""
        with self.lock:
            queued = self.num_queued_bytes
            fits = not queued or queued + num_bytes <= self.max_queued_bytes
            if fits:
                self.num_queued_bytes += num_bytes
        if fits:
            try:
                return self.queue.put_nowait((record, num_bytes))
            except queue.Full:
                self._give_back(num_bytes)
        self.num_dropped += 1
        if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
            log.warning("capture: %d records dropped: the writer falls behind", self.num_dropped)

    def _give_back(self, num_bytes: int) -> None:
        with self.lock:
            self.num_queued_bytes -= num_bytes

    def _write_loop(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                break
            record, num_bytes = item
            try:
                record.body = redact(record.body, self.secrets)
                self.files.append(record.to_line().encode())
                self.num_written += 1
            except Exception:  # a full disk or an unwritable folder: counted and logged, never the gateway's end
                self.num_failed += 1
                if self.num_failed == 1 or self.num_failed % 1000 == 0:
                    log.exception("capture: %d records could not be written", self.num_failed)
            finally:
                self._give_back(num_bytes)
                del record, item  # not held while the queue is empty
        self.files.close()

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued, then close the file."""
        self.queue.put(None)
        self.thread.join(timeout_s)

    def request(self, request_id: str, trace_id: str, model: str, endpoint: str, arrived_at: float):
        """A new request's record; arrived_at: its arrival on the wall clock, as its RequestTrace has it."""
        arrived_monotonic = time.monotonic() - (time.time() - arrived_at)
        return CapturedRequest(
            self, Record(request_id, trace_id, model, arrived_at, arrived_monotonic, endpoint, 0, None)
        )


@dataclass
class CapturedRequest:
    """One request's record as it forms, fed by its RequestTrace, whose times are the metrics': the capture and
    /metrics agree."""

    writer: CaptureWriter
    record: Record
    flights: list = field(default_factory=list)  # its Flights (one per prompt), for the workers that served it
    choices: object = None  # its Choices, for the output text
    num_body_bytes: int = 0  # its body as sent

    def tokens(self, choice: int, token_ids: list[int], since_arrival_s: float, gap_s: float | None) -> None:
        """A choice's tokens came, since_arrival_s after the request; gap_s: how long each waited after the choice's
        token before (None for its first)."""
        r = self.record
        while len(r.output_token_ids) <= choice:
            r.output_token_ids.append([])
            r.itl_s.append([])
        if r.ttft_s is None:
            r.ttft_s = since_arrival_s
        if gap_s is not None:
            r.itl_s[choice].extend([gap_s] * len(token_ids))
        r.output_token_ids[choice].extend(token_ids)

    def finish(self, status: int, reasons: str | None, error: str | None, since_arrival_s: float) -> None:
        r = self.record  # called once: RequestTrace.finish ends a request once
        r.status, r.error, r.e2e_s = status, error or "", since_arrival_s
        r.finish_reasons = reasons.split(",") if reasons else []
        if self.choices is not None:
            r.output_text = ["".join(state.pieces) for state in self.choices.states]
        flights = sorted(self.flights, key=lambda f: (len(f.request_id), f.request_id))  # rid/p2 before rid/p10
        r.routes = [list(f.routes) for f in flights]
        r.moves = sum(f.num_moves for f in flights)
        self.writer.submit(r, self.num_body_bytes + _output_bytes(r))


def _output_bytes(r: Record) -> int:
    """About what a record's output takes on its line: its text, and each token's id and gap."""
    num_tokens = sum(map(len, r.output_token_ids))
    return sum(map(len, r.output_text)) + 16 * num_tokens
