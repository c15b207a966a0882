"""Log set-up for every kvferry process: plain text by default, JSON lines with --log-format json.

A log line about a request carries its id: pass extra={"request_id": rid}, or, in the gateway,
set request_id_var for the request's task and every line logged inside it gets the id.
"""

import contextvars
import json
import logging
import time

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("kvferry_request_id", default="")
FORMATS = ("text", "json")


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
        return json.dumps(line)


class TextFormatter(logging.Formatter):
    def __init__(self):
        super().__init__("%(asctime)s %(name)s %(levelname)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return f"{text} [{record.request_id}]" if record.request_id else text


def setup_logging(log_format: str, process: str, level: int = logging.INFO) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter(process) if log_format == "json" else TextFormatter())
    handler.addFilter(_RequestId())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
