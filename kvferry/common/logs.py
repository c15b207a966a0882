"""Log set-up for every kvferry process: plain text by default, JSON lines with --log-format json.

A line about a request carries its id: pass extra={"request_id": rid}, or, in the gateway, set request_id_var for
the request's task. A line often quotes what a client sent, so the text format escapes every control character and
Unicode line break in the whole line, traceback included: a value cannot forge a line of its own, nor a terminal
escape repaint the reader's screen. json.dumps does the same inside the JSON format's strings.
"""

import contextvars
import json
import logging
import time

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("kvferry_request_id", default="")
FORMATS = ("text", "json")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
# C0 controls, DEL, C1 controls (NEL among them) and the Unicode line and paragraph separators.
_ESCAPES = {
    code: _NAMED.get(chr(code), f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
    for code in (*range(0x20), *range(0x7F, 0xA0), 0x2028, 0x2029)
}


def escape_controls(text: str) -> str:
    """text on one line: each control character and line break written as its backslash escape."""
    return text.translate(_ESCAPES)


class _RequestId(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "request_id", ""):
            record.request_id = request_id_var.get()
        return True


class JsonFormatter(logging.Formatter):
    def __init__(self, process: str):
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": round(record.created, 6),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)),
            "level": record.levelname.lower(),
            "logger": record.name,
            "process": self.process,
            "msg": record.getMessage(),
        }
        if record.request_id:
            line["request_id"] = record.request_id
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        # ensure_ascii escapes every control character and line break; default=str: an odd extra still logs
        return json.dumps(line, ensure_ascii=True, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self):
        super().__init__("%(asctime)s %(name)s %(levelname)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)  # the message, and the traceback on lines of its own
        return escape_controls(f"{text} [{record.request_id}]" if record.request_id else text)


def setup_logging(log_format: str, process: str, level: int = logging.INFO) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter(process) if log_format == "json" else TextFormatter())
    handler.addFilter(_RequestId())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
