"""A synthetic worker's send counts in their mapped file (bench/synthetic/send_counts.py): what the double counts is
what a reader of the file sees, at once and without asking it; a file not mapped yet reads as zeros."""

import subprocess
import sys

from kvferry.tools.bench.synthetic.send_counts import SENT, UNSENT, WAITED, SendCounts, read_send_counts


def test_a_count_is_in_the_file_as_soon_as_it_moves(tmp_path):
    path = tmp_path / "decode.counts"
    assert read_send_counts(path) == {"sent": 0, "waited": 0, "unsent": 0}
    counts = SendCounts(path)
    try:
        counts.counts[SENT] += 5
        counts.counts[WAITED] += 2
        assert read_send_counts(path) == {"sent": 5, "waited": 2, "unsent": 0} == counts.snapshot()
        # Another process reads it as the bench does, while this one still holds it mapped.
        read = "import sys; from kvferry.tools.bench.synthetic import send_counts; "
        read += "print(send_counts.read_send_counts(sys.argv[1]))"
        counts.counts[UNSENT] += 1
        done = subprocess.run([sys.executable, "-c", read, str(path)], capture_output=True, text=True, check=True)
        assert done.stdout.strip() == "{'sent': 5, 'waited': 2, 'unsent': 1}"
    finally:
        counts.close()
    assert read_send_counts(path)["sent"] == 5  # the file stays once the double has gone


def test_without_a_file_the_counts_live_in_memory():
    counts = SendCounts()
    counts.counts[SENT] += 1
    assert counts.snapshot() == {"sent": 1, "waited": 0, "unsent": 0}
    counts.close()
