"""The capture folder's files (users' prompts and outputs): private, never opened through a planted name, rotated
without deleting another gateway's open file.

The folder is made 0700 and each file 0600, created with O_EXCL|O_NOFOLLOW: a name someone else made first is skipped,
never written through. Files are named capture-<UTC time>-<gateway id>-<sequence>.jsonl, so that they sort in the
order written and several gateways can share the folder. Each holds an exclusive flock on the file it writes; past
--capture-max-total-bytes a gateway deletes the oldest files whose lock it can take, so a live gateway's open file
stays and a dead one's goes. A file is rotated once it reaches --capture-max-bytes.
"""

import fcntl
import logging
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from kvferry.common import settings
from kvferry.common.capture import FILE_PREFIX, FILE_SUFFIX
from kvferry.common.errors import ConfigError
from kvferry.common.gateway_config import GatewayConfig

log = logging.getLogger("kvferry.gateway")
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_APPEND | os.O_CLOEXEC
PROBE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a planted FIFO cannot stall
MAX_NAME_TRIES = 100  # names taken in a row before the file counts as unwritable


@dataclass
class CaptureLimits:
    max_file_bytes: int = GatewayConfig.capture_max_bytes
    max_total_bytes: int = GatewayConfig.capture_max_total_bytes

    def __post_init__(self):
        if self.max_total_bytes < self.max_file_bytes:
            raise ConfigError(
                f"{settings.label('capture_max_total_bytes')} ({self.max_total_bytes}) is below "
                f"{settings.label('capture_max_bytes')} ({self.max_file_bytes}): one file would not fit"
            )


def warn_if_shared(folder: Path) -> None:
    """A warning for a folder whose files others could plant, swap or delete."""
    info = folder.stat()
    if info.st_uid != os.geteuid():
        log.warning(
            "capture: the folder %s is owned by user id %d, not by this gateway's (%d): that user can read and "
            "replace the captured traffic; point %s at a folder of this user's own",
            folder, info.st_uid, os.geteuid(), settings.label("capture_dir"),
        )  # fmt: skip
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        log.warning(
            "capture: the folder %s is group- or world-writable (mode %03o): other users can plant or delete "
            "capture files; chmod 700 %s",
            folder, stat.S_IMODE(info.st_mode), folder,
        )  # fmt: skip


def delete_unless_written(path: Path) -> bool:
    """Delete a capture file unless a live gateway holds its lock; True if it was deleted."""
    try:
        fd = os.open(path, PROBE_FLAGS)
    except OSError:  # gone, a symlink, or another user's: not ours to delete
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.fstat(fd).st_ino != path.lstat().st_ino:  # replaced since it was opened
            return False
        path.unlink()
        return True
    except OSError:  # BlockingIOError: a gateway writes it; FileNotFoundError: another deleted it first
        return False
    finally:
        os.close(fd)


class CaptureFiles:
    """The folder's capture files: appends lines, rotates by size and deletes the oldest past the total cap. Used
    by one thread."""

    def __init__(self, folder: str | Path, owner: str, limits: CaptureLimits):
        self.folder, self.owner, self.limits = Path(folder), owner, limits
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        warn_if_shared(self.folder)
        self.file = None
        self.path: Path | None = None
        self.size = 0
        self.sequence = 0

    def append(self, line: bytes) -> None:
        if self.file is not None and self.size + len(line) > self.limits.max_file_bytes and self.size:
            self._close()
        if self.file is None:
            self._open()
        self.file.write(line)
        self.file.flush()  # a crash loses no finished line
        self.size += len(line)

    def _open(self) -> None:
        for _ in range(MAX_NAME_TRIES):
            self.sequence += 1
            stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
            path = self.folder / f"{FILE_PREFIX}{stamp}-{self.owner}-{self.sequence:06d}{FILE_SUFFIX}"
            fd = self._create_locked(path)
            if fd is not None:
                self.path, self.file, self.size = path, open(fd, "ab"), 0
                self._enforce_total()
                return
        raise OSError(f"capture: {MAX_NAME_TRIES} file names in a row were already taken in {self.folder}")

    @staticmethod
    def _create_locked(path: Path) -> int | None:
        """A new file at path, 0600, locked for writing; None if the name is taken."""
        try:
            fd = os.open(path, CREATE_FLAGS, 0o600)
        except FileExistsError:
            log.warning("capture: %s already exists, made by someone else; writing the next name instead", path)
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.fstat(fd).st_ino == path.lstat().st_ino:  # not deleted by a rotation before the lock was taken
                return fd
        except OSError:  # another gateway's rotation holds it (and may delete it): take the next name
            pass
        os.close(fd)
        return None

    def _close(self) -> None:
        self.file.close()  # releases the lock: from now on any gateway's rotation may delete it
        self.file = None

    def _enforce_total(self) -> None:
        """Delete the oldest capture files until the folder is within the cap, skipping every open one."""
        files = []
        for path in self.folder.glob(f"{FILE_PREFIX}*{FILE_SUFFIX}"):
            try:
                info = path.lstat()
            except FileNotFoundError:  # another gateway sharing the folder deleted it
                continue
            if stat.S_ISREG(info.st_mode):
                files.append((info.st_mtime, path.name, info.st_size, path))
        files.sort()
        total = sum(size for _, _, size, _ in files)
        room = self.limits.max_total_bytes - self.limits.max_file_bytes  # the open file may grow to its own cap
        for _, _, size, old in files:
            if total <= room:
                break
            if old != self.path and delete_unless_written(old):
                total -= size

    def close(self) -> None:
        if self.file is not None:
            self._close()
