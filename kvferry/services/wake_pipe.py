"""A pipe that wakes a worker's poll loop from another thread: the thread writes a byte, the loop polls the read
end with its sockets and clears it before taking what the thread left."""

import os


def pipe() -> tuple[int, int]:
    """(read fd, write fd), both non-blocking."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    os.set_blocking(write_fd, False)
    return read_fd, write_fd


def signal(fd: int) -> None:
    try:
        os.write(fd, b"\0")
    except BlockingIOError:
        pass  # the pipe is full of wake-ups already: the reader wakes anyway


def clear(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass
