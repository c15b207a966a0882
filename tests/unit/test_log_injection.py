"""A request-derived value with line breaks or terminal escapes cannot forge a log line, in either log format."""

import io
import json
import logging

import pytest

from kvferry.common.logs import request_id_var, setup_logging

FORGED = "tiny\n2025-01-01 00:00:00,000 kvferry.gateway INFO admin logged in\r\x1b[2J\u2028end"


@pytest.fixture
def logged():
    """Log through the real set-up into a string: (log format) -> the lines written."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level

    def run(log_format: str) -> list[str]:
        setup_logging(log_format, "gateway")
        stream = io.StringIO()
        root.handlers[0].setStream(stream)
        log = logging.getLogger("kvferry.gateway")
        token = request_id_var.set("cmpl-1\nforged")
        try:
            log.warning("no model %r; the user %s", FORGED, FORGED)
            log.info(FORGED)
            try:
                raise ValueError(f"bad model {FORGED}")
            except ValueError:
                log.exception("request failed: %s", FORGED)
        finally:
            request_id_var.reset(token)
        return stream.getvalue().split("\n")[:-1]  # split on "\n" alone: splitlines() would hide a \u2028 break

    yield run
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])


def test_text_logs_write_one_line_per_record_with_the_breaks_escaped(logged):
    lines = logged("text")
    assert len(lines) == 3, lines
    for line in lines:
        assert not any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F or c in "\u2028\u2029" for c in line), line
    assert "tiny\\n2025-01-01" in lines[1] and "\\x1b[2J" in lines[1] and "\\u2028end" in lines[1]
    assert lines[0].endswith("[cmpl-1\\nforged]")
    assert "Traceback" in lines[2] and "ValueError: bad model tiny\\n" in lines[2]  # the trace kept, on its line


def test_json_logs_stay_one_valid_object_per_record(logged):
    lines = logged("json")
    assert len(lines) == 3, lines
    records = [json.loads(line) for line in lines]
    assert records[1]["msg"] == FORGED  # JSON escapes it; the reader gets the value back exactly
    assert records[0]["request_id"] == "cmpl-1\nforged" and FORGED in records[2]["exc"]
