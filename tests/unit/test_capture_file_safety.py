"""Capture files hold prompts and outputs: private modes, no following a planted name, a folder others may write
named in a warning, and one gateway's rotation never deleting a file another gateway is writing."""

import json
import logging
import os
import stat
import time

from kvferry.common import capture
from kvferry.services.gateway.capture import CaptureFiles, CaptureLimits


def line(i: int, pad: int = 180) -> bytes:
    return (json.dumps({"i": i, "pad": "x" * pad}) + "\n").encode()


def test_the_folder_is_made_0700_and_files_0600(tmp_path):
    folder = tmp_path / "a" / "cap"
    files = CaptureFiles(folder, "gw-1", CaptureLimits(max_file_bytes=4096, max_total_bytes=8192))
    files.append(line(0))
    files.close()
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    [written] = folder.glob("capture-*.jsonl")
    assert stat.S_IMODE(written.stat().st_mode) == 0o600


def test_a_planted_symlink_or_file_at_the_next_name_is_never_written_through(tmp_path):
    folder, target = tmp_path / "cap", tmp_path / "victim"
    folder.mkdir(mode=0o700)
    target.write_text("keep\n")
    # Another user guesses the next names (time, gateway id, sequence) and plants a link or a file of their own.
    now = time.time()
    for second in range(-2, 30):
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now + second))
        (folder / f"capture-{stamp}-gw-1-000001.jsonl").symlink_to(target)
        (folder / f"capture-{stamp}-gw-1-000002.jsonl").write_text("")
    files = CaptureFiles(folder, "gw-1", CaptureLimits(max_file_bytes=4096, max_total_bytes=2**20))
    files.append(line(7))
    files.close()
    assert target.read_text() == "keep\n"
    assert files.path.is_file() and not files.path.is_symlink()
    assert json.loads(files.path.read_text())["i"] == 7


def test_rotation_never_deletes_a_file_another_gateway_is_writing(tmp_path):
    limits = CaptureLimits(max_file_bytes=1000, max_total_bytes=3000)
    slow = CaptureFiles(tmp_path, "gw-slow", limits)
    slow.append(line(-1))  # the oldest file in the folder, and still open
    busy = CaptureFiles(tmp_path, "gw-busy", limits)
    for i in range(60):
        busy.append(line(i))
    slow.append(line(-2))
    assert slow.path.exists(), "another gateway's rotation deleted the file this one writes"
    assert [json.loads(x)["i"] for x in slow.path.read_text().splitlines()] == [-1, -2]
    slow.close()
    busy.close()
    # Closed, the slow gateway's file is the oldest and goes at the next rotation like any other.
    for i in range(60, 70):
        busy.append(line(i))
    busy.close()
    assert not slow.path.exists()
    assert sum(p.stat().st_size for p in tmp_path.glob("capture-*.jsonl")) <= limits.max_total_bytes


def test_a_dead_gateways_files_are_deleted_past_the_total(tmp_path):
    limits = CaptureLimits(max_file_bytes=1000, max_total_bytes=3000)
    for n in range(5):  # what a gateway that was killed left, its last file never closed
        (tmp_path / f"capture-20000101T00000{n}-gw-dead-00000{n}.jsonl").write_bytes(line(n, 800))
    files = CaptureFiles(tmp_path, "gw-new", limits)
    files.append(line(99))
    files.close()
    assert sum(p.stat().st_size for p in tmp_path.glob("capture-*.jsonl")) <= limits.max_total_bytes
    assert files.path.exists()


def test_a_folder_others_may_write_is_named_in_a_warning(tmp_path, caplog):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with caplog.at_level(logging.WARNING, "kvferry.gateway"):
        CaptureFiles(shared, "gw-1", CaptureLimits()).close()
    assert any(str(shared) in r.getMessage() and "writable" in r.getMessage() for r in caplog.records)
    caplog.clear()
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534) if os.geteuid() == 0 else None
    with caplog.at_level(logging.WARNING, "kvferry.gateway"):
        CaptureFiles(theirs, "gw-1", CaptureLimits()).close()
    if os.geteuid() == 0:
        assert any(str(theirs) in r.getMessage() and "owned by" in r.getMessage() for r in caplog.records)
    caplog.clear()
    mine = tmp_path / "mine"
    with caplog.at_level(logging.WARNING, "kvferry.gateway"):
        CaptureFiles(mine, "gw-1", CaptureLimits()).close()
    assert not caplog.records


def test_records_still_load_from_the_private_files(tmp_path):
    files = CaptureFiles(tmp_path / "cap", "gw-1", CaptureLimits())
    record = capture.Record("cmpl-1", "ab" * 16, "m", 1000.0, 5.0, "/v1/completions", 200, {"prompt": "x"})
    files.append(record.to_line().encode())
    files.close()
    assert [r.request_id for r in capture.load([tmp_path / "cap"])] == ["cmpl-1"]
