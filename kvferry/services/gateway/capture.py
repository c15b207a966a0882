"""Traffic capture: one JSON line per finished request (common/capture.py has the format), for replay and planning.

Off unless --capture-dir is given. The event loop only gathers a request's figures into a Record, which costs a list
append per token message; serializing, redacting and writing happen on one writer thread, so a large body never
holds up the loop. The queue to that thread is bounded: past it, records are dropped and counted, never waited for.

Files are named capture-<UTC time>-<gateway id>-<sequence>.jsonl, so that a folder's files sort in the order they
were written and several gateways can share one folder. A file past --capture-max-bytes is closed and the next one
started; past --capture-max-total-bytes in the folder, the oldest capture files are deleted.
"""

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvferry.common import settings
from kvferry.common.capture import FILE_PREFIX, FILE_SUFFIX, Record, redact
from kvferry.common.errors import ConfigError

log = logging.getLogger("kvferry.gateway")
MAX_QUEUED_RECORDS = 1024  # finished requests waiting for the writer thread; past it they are dropped


@dataclass
class CaptureLimits:
    max_file_bytes: int = 64 * 2**20
    max_total_bytes: int = 2**30

    def __post_init__(self):
        if self.max_total_bytes < self.max_file_bytes:
            raise ConfigError(
                f"{settings.label('capture_max_total_bytes')} ({self.max_total_bytes}) is below "
                f"{settings.label('capture_max_bytes')} ({self.max_file_bytes}): one file would not fit"
            )


class CaptureFiles:
    """The folder's capture files: appends lines, rotates by size and deletes the oldest past the total cap. Used
    by one thread."""

    def __init__(self, folder: str | Path, owner: str, limits: CaptureLimits):
        self.folder, self.owner, self.limits = Path(folder), owner, limits
        self.folder.mkdir(parents=True, exist_ok=True)
        self.file = None
        self.path: Path | None = None
        self.size = 0
        self.sequence = 0

    def append(self, line: bytes) -> None:
        if self.file is not None and self.size + len(line) > self.limits.max_file_bytes and self.size:
            self._close()
        if self.file is None:
            self._open()
        self.file.write(line)
        self.file.flush()  # a crash loses no finished line
        self.size += len(line)

    def _open(self) -> None:
        self.sequence += 1
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        self.path = self.folder / f"{FILE_PREFIX}{stamp}-{self.owner}-{self.sequence:06d}{FILE_SUFFIX}"
        self.file, self.size = open(self.path, "ab"), 0
        self._enforce_total()

    def _close(self) -> None:
        self.file.close()
        self.file = None

    def _enforce_total(self) -> None:
        """Delete the oldest capture files (any gateway's) until the folder is within the cap; never the open one."""
        files = []
        for path in self.folder.glob(f"{FILE_PREFIX}*{FILE_SUFFIX}"):
            try:
                stat = path.stat()
            except FileNotFoundError:  # another gateway sharing the folder deleted it
                continue
            files.append((stat.st_mtime, path.name, stat.st_size, path))
        files.sort()
        total = sum(size for _, _, size, _ in files)
        room = self.limits.max_total_bytes - self.limits.max_file_bytes  # the open file may grow to its own cap
        for _, _, size, old in files:
            if total <= room or old == self.path:
                break
            old.unlink(missing_ok=True)
            total -= size

    def close(self) -> None:
        if self.file is not None:
            self._close()


class CaptureWriter:
    """The gateway's capture: records come from the event loop, lines go out on the writer thread."""

    def __init__(self, folder: str | Path, owner: str, limits: CaptureLimits, secrets: tuple[str, ...] = ()):
        self.files = CaptureFiles(folder, owner, limits)  # the folder is made now: a bad path fails at start
        self.secrets = tuple(s for s in secrets if s)
        self.queue: queue.Queue = queue.Queue(MAX_QUEUED_RECORDS)
        self.num_written = self.num_dropped = self.num_failed = 0
        self.thread = threading.Thread(target=self._write_loop, name="kvferry-capture", daemon=True)
        self.thread.start()

    def submit(self, record: Record) -> None:
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                log.warning("capture: %d records dropped: the writer falls behind", self.num_dropped)

    def _write_loop(self) -> None:
        while True:
            record = self.queue.get()
            if record is None:
                break
            try:
                record.body = redact(record.body, self.secrets)
                self.files.append(record.to_line().encode())
                self.num_written += 1
            except Exception:  # a full disk or an unwritable folder: counted and logged, never the gateway's end
                self.num_failed += 1
                if self.num_failed == 1 or self.num_failed % 1000 == 0:
                    log.exception("capture: %d records could not be written", self.num_failed)
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
    """One request's record as it forms, fed by the gateway's RequestTrace: its times are the ones the trace
    measures for the metrics (TTFT, each inter-token gap, e2e), so the capture and /metrics agree."""

    writer: CaptureWriter
    record: Record
    flights: list = field(default_factory=list)  # its Flights (one per prompt), for the workers that served it
    choices: object = None  # its Choices, for the output text

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
        self.writer.submit(r)
