"""A pipe that wakes a worker's poll loop from another thread: the thread writes a byte, the loop polls the read
end with its sockets and clears it before taking what the thread left."""

import contextlib
import os


def pipe() -> tuple[int, int]:
    """(read fd, write fd), both non-blocking."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    os.set_blocking(write_fd, False)
    return read_fd, write_fd


def signal(fd: int) -> None:
    with contextlib.suppress(BlockingIOError):  # the pipe is full of wake-ups already: the reader wakes anyway
        os.write(fd, b"\0")


def clear(fd: int) -> None:
    with contextlib.suppress(BlockingIOError):
        while os.read(fd, 4096):
            pass
