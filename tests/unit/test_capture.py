"""The capture's format and files: redaction, versions, unreadable lines named, rotation and the total cap."""

import json

import pytest

from kvferry.common import capture
from kvferry.common.errors import ConfigError
from kvferry.services.gateway.capture import CaptureFiles, CaptureLimits, CaptureWriter


def record(i: int, **fields) -> capture.Record:
    return capture.Record(
        f"cmpl-{i}", "ab" * 16, "m", 1000.0 + i, 50.0 + i, "/v1/completions", 200, {"prompt": "x"}, **fields
    )


def test_redact_hides_secret_fields_and_the_key_wherever_it_appears():
    body = {
        "messages": [{"role": "user", "content": "my key is sk-live-42, keep it"}],
        "API_KEY": "whatever",
        "extra": {"password": "hunter2", "max_tokens": 5},
        "n": 2,
    }
    hidden = capture.redact(body, ["sk-live-42", ""])
    assert hidden["messages"][0]["content"] == f"my key is {capture.REDACTED}, keep it"
    assert hidden["API_KEY"] == capture.REDACTED and hidden["extra"] == {"password": capture.REDACTED, "max_tokens": 5}
    assert hidden["n"] == 2 and "sk-live-42" in body["messages"][0]["content"]  # a copy: the request keeps its own


def test_a_record_round_trips_and_other_versions_are_refused_by_name():
    line = record(1, output_token_ids=[[1, 2]], finish_reasons=["length"]).to_line()
    assert capture.parse_line(line, "f:1") == record(1, output_token_ids=[[1, 2]], finish_reasons=["length"])
    old = json.dumps({**json.loads(line), "v": 0})
    with pytest.raises(capture.CaptureError, match=r"f:7: capture format version 0; this kvferry reads version 1"):
        capture.parse_line(old, "f:7")


def test_unreadable_lines_are_skipped_and_named_by_file_and_line(tmp_path):
    good = [record(i).to_line() for i in range(3)]
    (tmp_path / "capture-a.jsonl").write_text(good[2] + good[0][:40] + "\n" + "[1, 2]\n")
    (tmp_path / "capture-b.jsonl").write_text(good[1] + '{"v": 1, "request_id": "x"}\n')
    (tmp_path / "notes.txt").write_text("not a capture file\n")
    skipped = []
    records = capture.load([tmp_path], skipped.append)
    assert [r.request_id for r in records] == ["cmpl-1", "cmpl-2"]  # by arrival, whatever the file order
    assert [s.split(": ")[0] for s in skipped] == [
        f"{tmp_path / 'capture-a.jsonl'}:2",
        f"{tmp_path / 'capture-a.jsonl'}:3",
        f"{tmp_path / 'capture-b.jsonl'}:2",
    ]
    assert "truncated" in skipped[0] and "arrival_unix" in skipped[2]
    with pytest.raises(FileNotFoundError, match="no capture file or folder"):
        capture.load([tmp_path / "missing"])


def test_files_rotate_by_size_and_the_oldest_go_past_the_total_cap(tmp_path):
    limits = CaptureLimits(max_file_bytes=1000, max_total_bytes=3000)
    files = CaptureFiles(tmp_path, "gw-test", limits)
    lines = [(json.dumps({"i": i, "pad": "x" * 180}) + "\n").encode() for i in range(60)]
    for line in lines:
        files.append(line)
    files.close()
    kept = sorted(tmp_path.glob("capture-*.jsonl"))
    sizes = [p.stat().st_size for p in kept]
    assert len(kept) >= 2 and all(size <= limits.max_file_bytes for size in sizes)
    assert sum(sizes) <= limits.max_total_bytes
    written = [json.loads(line)["i"] for p in kept for line in p.read_text().splitlines()]
    assert written == list(range(60 - len(written), 60))  # the newest, in order, none lost in between
    assert len(written) < 60  # the oldest files were deleted
    with pytest.raises(ConfigError, match="capture-max-total-bytes"):
        CaptureLimits(max_file_bytes=2000, max_total_bytes=1000)


def test_the_writer_thread_writes_every_record_redacted(tmp_path):
    writer = CaptureWriter(tmp_path / "cap", "gw-x", CaptureLimits(), secrets=("sk-123",))
    for i in range(5):
        r = record(i)
        r.body = {"prompt": f"sk-123 {i}"}
        writer.submit(r)
    writer.close()
    records = capture.load([tmp_path / "cap"])
    assert [r.body["prompt"] for r in records] == [f"{capture.REDACTED} {i}" for i in range(5)]
    assert writer.num_written == 5 and writer.num_dropped == 0
