"""The traffic capture's format: one JSON object per line, one line per finished request.

The gateway writes it (services/gateway/capture.py); `kvferry replay`, `simulate` and `plan` read it. Every
line carries the format's version, so a folder may hold files of several versions after an upgrade: a reader
takes the versions it knows and names the others. Standard library only: the gateway imports this.

A record's fields, by name (times in seconds):
- v: FORMAT_VERSION; request_id; trace_id (32 hex digits, as in the traceparent header); model (served name)
- arrival_unix, arrival_monotonic: when the HTTP request arrived, on the wall clock and the gateway's monotonic one.
  Readers order and space arrivals by the wall clock, the one clock that several gateways' files share
- endpoint: the HTTP path; status: the HTTP status (499: the client left); error: "" or the error's message
- body: the request body as parsed, with secrets replaced by REDACTED (None when it was not JSON)
- prompt_token_ids: one list per prompt (a completions request may carry several)
- output_token_ids, output_text, finish_reasons: one entry per choice, in the response's order
- ttft_s: arrival to the first token (None: none came); itl_s: per choice, the gaps between its tokens (a
  message of k tokens counts k gaps of a k-th of its wait each, as the gateway's histogram does); e2e_s: arrival
  to the end
- routes: per prompt, per attempt, {"prefill": worker id, "decode": worker id}; moves: attempts past the first

A capture may be read long after and elsewhere, and a line may be cut off, edited or crafted: a wrong type would
surface as a traceback deep in a report, a negative or endless time as a replay that sleeps for ever, a deeply nested
body as a RecursionError. So every field is checked by type and range (FIELDS), and a line that fails is named and
skipped.
"""

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import BinaryIO

FORMAT_VERSION = 1
FILE_PREFIX, FILE_SUFFIX = "capture-", ".jsonl"
REDACTED = "[redacted]"
# A reader skips a longer line unread. A line is a body (8 MiB by default, --max-body-size) with its prompt's token
# ids and outputs: far below this, even with a larger body cap.
MAX_LINE_BYTES = 256 * 2**20
# Body fields whose value is a secret wherever they appear, compared in lower case. OpenAI's API has none, but
# clients and proxies put credentials into extra fields.
SECRET_FIELDS = frozenset(
    {"api_key", "apikey", "api-key", "authorization", "password", "secret", "access_token", "token", "bearer"}
)


@dataclass
class Record:
    request_id: str
    trace_id: str
    model: str
    arrival_unix: float
    arrival_monotonic: float
    endpoint: str
    status: int
    body: dict | None
    error: str = ""
    prompt_token_ids: list[list[int]] = field(default_factory=list)
    output_token_ids: list[list[int]] = field(default_factory=list)
    output_text: list[str] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)
    ttft_s: float | None = None
    itl_s: list[list[float]] = field(default_factory=list)
    e2e_s: float = 0.0
    routes: list[list[dict]] = field(default_factory=list)
    moves: int = 0
    v: int = FORMAT_VERSION

    def to_line(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False, separators=(",", ":"), allow_nan=False) + "\n"

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(ids) for ids in self.output_token_ids)


def redact(body, secrets: Iterable[str] = ()):
    """A copy of a JSON body with every SECRET_FIELDS value, and each occurrence of one of secrets (the server's API
    key) in its strings, replaced by REDACTED."""
    hidden = frozenset(s for s in secrets if s)

    def walk(value):
        if isinstance(value, dict):
            return {k: REDACTED if str(k).lower() in SECRET_FIELDS else walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, str):
            for secret in hidden:
                value = value.replace(secret, REDACTED)
        return value

    return walk(body)


# -- what each field of a line may hold --------------------------------------------------------------------------------
MAX_BODY_DEPTH = 64  # the gateway refuses a body nested deeper (services/gateway/json_body.py), so none is captured


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value) -> bool:
    """A finite number, of any sign (an int too large for a float is not one)."""
    if not (_is_int(value) or isinstance(value, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _is_time(value) -> bool:
    """A finite, non-negative number of seconds."""
    return _is_finite(value) and value >= 0


def _list_of(check):
    return lambda value: isinstance(value, list) and all(check(v) for v in value)


def _depth_within(value, limit: int) -> bool:
    """Whether value nests at most limit lists and objects deep; iterative, so any depth is safe to ask about."""
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict | list):
            if depth > limit:
                return False
            pending.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return True


_ids = _list_of(_list_of(_is_int))
# Each field -> (its check, what it must be, for the message). A field may be absent where Record has a default.
FIELDS = {
    "request_id": (lambda v: isinstance(v, str), "a string"),
    "trace_id": (lambda v: isinstance(v, str), "a string"),
    "model": (lambda v: isinstance(v, str), "a string"),
    "arrival_unix": (_is_time, "a finite time in seconds, at least 0"),
    "arrival_monotonic": (_is_finite, "a finite number"),
    "endpoint": (lambda v: isinstance(v, str), "a string"),
    "status": (_is_int, "an integer"),
    "body": (lambda v: v is None or isinstance(v, dict), "an object or null"),
    "error": (lambda v: isinstance(v, str), "a string"),
    "prompt_token_ids": (_ids, "a list of lists of integers"),
    "output_token_ids": (_ids, "a list of lists of integers"),
    "output_text": (_list_of(lambda v: isinstance(v, str)), "a list of strings"),
    "finish_reasons": (_list_of(lambda v: v is None or isinstance(v, str)), "a list of strings or nulls"),
    "ttft_s": (lambda v: v is None or _is_time(v), "null or a finite time in seconds, at least 0"),
    "itl_s": (_list_of(_list_of(_is_time)), "a list of lists of finite times in seconds, at least 0"),
    "e2e_s": (_is_time, "a finite time in seconds, at least 0"),
    "routes": (_list_of(_list_of(lambda v: isinstance(v, dict))), "a list of lists of objects"),
    "moves": (lambda v: _is_int(v) and v >= 0, "an integer, at least 0"),
}
REQUIRED = ("request_id", "arrival_unix", "endpoint", "status", "trace_id", "model", "arrival_monotonic", "body")


def problem(raw: dict) -> str | None:
    """What is wrong with a line's fields, or None."""
    for name in REQUIRED:
        if name not in raw:
            return f"field {name!r} is missing"
    for name, (check, must_be) in FIELDS.items():
        if name in raw and not check(raw[name]):
            return f"field {name!r} is not {must_be}"
    if not _depth_within(raw["body"], MAX_BODY_DEPTH):
        return f"field 'body' is nested more than {MAX_BODY_DEPTH} levels deep"
    return None


class CaptureError(ValueError):
    """A capture line that cannot be read; the message names its file and line."""


def parse_line(text: str, where: str) -> Record:
    """One line -> its Record, or CaptureError naming where (FILE:LINE) and why."""
    try:
        raw = json.loads(text)
    except RecursionError:
        raise CaptureError(f"{where}: JSON nested too deeply to read") from None
    except ValueError as exc:  # a JSONDecodeError, or an integer of more digits than Python converts
        raise CaptureError(f"{where}: not JSON ({getattr(exc, 'msg', exc)}); truncated or corrupt") from None
    if not isinstance(raw, dict):
        raise CaptureError(f"{where}: not a JSON object")
    version = raw.get("v")
    if version != FORMAT_VERSION:
        raise CaptureError(
            f"{where}: capture format version {version!r}; this kvferry reads version {FORMAT_VERSION} "
            "(capture again with this version's gateway)"
        )
    wrong = problem(raw)
    if wrong:
        raise CaptureError(f"{where}: {wrong}")
    known = {f for f in Record.__dataclass_fields__}
    return Record(**{k: v for k, v in raw.items() if k in known})


def capture_files(paths: Iterable[str | Path]) -> list[Path]:
    """Files and folders -> the capture files, a folder's in the order they were written (their names sort so).
    Only regular files: a FIFO or device under a capture's name would stall or flood the reader."""
    out = []
    for path in map(Path, paths):
        if path.is_dir():
            out.extend(sorted(p for p in path.glob(f"{FILE_PREFIX}*{FILE_SUFFIX}") if p.is_file()))
        elif path.is_file():
            out.append(path)
        elif path.exists():
            raise FileNotFoundError(f"{path} is not a regular file")
        else:
            raise FileNotFoundError(f"no capture file or folder {path}")
    return out


def _lines(file: BinaryIO, max_line_bytes: int) -> Iterator[bytes | None]:
    """The file's lines; None for one longer than max_line_bytes, which is read past in pieces, never held whole."""
    while line := file.readline(max_line_bytes + 1):
        if len(line) <= max_line_bytes or line.endswith(b"\n"):
            yield line
            continue
        while (piece := file.readline(2**20)) and not piece.endswith(b"\n"):
            pass
        yield None


def located_records(
    paths: Iterable[str | Path], on_skip=None, max_line_bytes: int = MAX_LINE_BYTES
) -> Iterator[tuple[str, Record]]:
    """(FILE:LINE, record) for every readable record of the files and folders, in file order. A line that cannot be
    read is skipped and on_skip(message) told, the message naming its file and line."""
    for path in capture_files(paths):
        with open(path, "rb") as f:
            for number, raw in enumerate(_lines(f, max_line_bytes), 1):
                where = f"{path}:{number}"
                try:
                    if raw is None:
                        raise CaptureError(f"{where}: longer than {max_line_bytes} bytes; no capture line is")
                    try:
                        text = raw.decode()
                    except UnicodeDecodeError as exc:
                        raise CaptureError(f"{where}: not UTF-8 text (byte {exc.start} of the line)") from None
                    if text.strip():
                        yield where, parse_line(text, where)
                except CaptureError as exc:
                    if on_skip is not None:
                        on_skip(str(exc))


def load(paths: Iterable[str | Path], on_skip=None, max_line_bytes: int = MAX_LINE_BYTES) -> list[Record]:
    """Every readable record (located_records, without the places), sorted by arrival."""
    return sorted(
        (record for _, record in located_records(paths, on_skip, max_line_bytes)), key=lambda r: r.arrival_unix
    )
