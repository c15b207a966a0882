"""A synthetic worker's send counts, in a small file it maps into its memory, so that `kvferry bench gateway` reads
them from outside between two loads: a count moves with each send at no system call, and a reading asks nothing of
the double. Without a file (the tests' doubles in process) the counts live in memory alone."""

import mmap
import struct
from pathlib import Path

FIELDS = ("sent", "waited", "unsent")  # every send; those that found the queue full and waited; those never sent
SENT, WAITED, UNSENT = range(len(FIELDS))
_LAYOUT = struct.Struct(f"{len(FIELDS)}q")  # native, as the memoryview below


class SendCounts:
    def __init__(self, path: str | Path | None = None):
        self._map = None
        if path is None:
            self.counts = [0] * len(FIELDS)
            return
        with open(path, "w+b") as f:
            f.truncate(_LAYOUT.size)
            self._map = mmap.mmap(f.fileno(), _LAYOUT.size)
        self.counts = memoryview(self._map).cast("q")  # counts[SENT] += 1: a store into the shared page

    def snapshot(self) -> dict[str, int]:
        return dict(zip(FIELDS, self.counts))

    def close(self) -> None:
        if self._map is not None:
            self.counts.release()
            self._map.close()
            self._map = None


def read_send_counts(path: str | Path) -> dict[str, int]:
    """A double's counts so far, by name (all 0 before it has mapped its file)."""
    data = Path(path).read_bytes() if Path(path).exists() else b""
    values = _LAYOUT.unpack(data) if len(data) == _LAYOUT.size else (0,) * len(FIELDS)
    return dict(zip(FIELDS, values))
