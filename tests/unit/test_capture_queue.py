"""The capture's queue to its writer thread is bounded in bytes, not only in records: records that hold whole bodies
wait there while the disk is slow. Past the bound, records are dropped and counted; serving never waits."""

import json
import threading

from kvferry.services.gateway.capture import CaptureWriter
from kvferry.services.gateway.capture_files import CaptureFiles, CaptureLimits

BODY_BYTES = 2**20


class SlowDisk(CaptureFiles):
    """The real files, written only once the test opens the gate: a disk that falls behind."""

    def __init__(self, *args):
        super().__init__(*args)
        self.gate = threading.Event()

    def append(self, line: bytes) -> None:
        self.gate.wait(60)  # a hang guard only
        super().append(line)


def finish_one(writer: CaptureWriter, i: int) -> None:
    """A finished request with a body of BODY_BYTES, through the gateway's own record of it."""
    captured = writer.request(f"cmpl-{i}", "ab" * 16, "m", "/v1/completions", 1000.0 + i)
    captured.record.body = {"prompt": "x" * (BODY_BYTES - len('{"prompt": ""}'))}
    captured.num_body_bytes = BODY_BYTES
    captured.tokens(0, [1, 2, 3], 0.1, None)
    captured.finish(200, "length", None, 0.2)


def test_records_past_the_queues_bytes_are_dropped_and_counted_never_waited_for(tmp_path):
    writer = CaptureWriter(tmp_path, "gw-test", CaptureLimits())
    disk = writer.files = SlowDisk(tmp_path, "gw-test", CaptureLimits())
    num = 64  # far fewer records than the queue's count allows, far more bytes than its byte bound
    for i in range(num):
        finish_one(writer, i)  # returns at once: the writer is stuck on the first
    assert writer.num_dropped > 0, "every record was queued: the queue holds 64 MiB of bodies"
    assert writer.num_queued_bytes <= writer.max_queued_bytes  # its most: nothing was written yet
    assert writer.num_dropped < num
    kept = num - writer.num_dropped
    disk.gate.set()
    writer.close(timeout_s=60)
    lines = [json.loads(line) for path in tmp_path.glob("capture-*.jsonl") for line in path.read_text().splitlines()]
    assert len(lines) == writer.num_written == kept
    assert writer.num_queued_bytes == 0


def test_a_lone_record_larger_than_the_bound_is_still_written(tmp_path):
    writer = CaptureWriter(tmp_path, "gw-test", CaptureLimits(), max_queued_bytes=1000)
    finish_one(writer, 0)
    writer.close(timeout_s=60)
    assert writer.num_written == 1 and writer.num_dropped == 0
