"""A cache folder only this process's user can write to, or a refusal that names the path and the fix.

What the cache holds is run or believed by every later process: compiled kernels are shared libraries the workers
load, converted models are the weights and tokenizer they serve. A folder or file that another user owns, or that
the group or the world may write, would let someone else put their code into every worker. So each folder from the
cache root down to a cached file, and the file, must be owned by this process's user and writable by nobody else
(0755 folders and 0644 files, as an umask of 022 makes them, pass).

It imports nothing of kvferry's and sits below every layer: the kernels (the lowest layer) check their builds with
it, and the model files (common) their conversions; common turns the refusal into a one-line ConfigError.
"""

import os
import pwd
import stat
from pathlib import Path


class UntrustedCache(Exception):
    """A cache folder or file that someone else could have written: the message names it and the fix."""


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _refuse(path: Path, why: str, fix: str) -> UntrustedCache:
    return UntrustedCache(
        f"refusing the cache path {path}: {why}, and what the cache holds runs in every kvferry process, so no one "
        f"but its owner may write it. Fix: {fix}"
    )


def _check_one(path: Path, status: os.stat_result) -> None:
    kind = "folder" if stat.S_ISDIR(status.st_mode) else "file"
    redo = f"or delete it (kvferry makes it again): rm -r {path}"
    if stat.S_ISLNK(status.st_mode):
        raise _refuse(path, "it is a symbolic link inside the cache folder", f"rm {path} (kvferry makes it again)")
    if status.st_uid != os.geteuid():
        me = _user(os.geteuid())
        why = f"the {kind} belongs to {_user(status.st_uid)}, not to {me} who runs kvferry"
        raise _refuse(path, why, f"chown {me} {path}, if you trust what it holds, {redo}")
    writable = status.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if writable:
        who = " and ".join(
            name for bit, name in ((stat.S_IWGRP, "its group"), (stat.S_IWOTH, "everyone")) if writable & bit
        )
        why = f"{who} may write the {kind} (mode {stat.S_IMODE(status.st_mode):04o})"
        raise _refuse(path, why, f"chmod go-w {path}, if you trust what it holds, {redo}")


def _chain(path: Path, root: Path) -> list[Path]:
    """root, then each folder below it down to path, then path."""
    chain = [root]
    for part in path.relative_to(root).parts:
        chain.append(chain[-1] / part)
    return chain


def check(path: Path, root: Path) -> None:
    """Raise UntrustedCache unless root, every folder between it and path, and path are this user's alone. root may
    be a symbolic link (to a folder that passes); nothing below it may."""
    root, path = Path(root), Path(path)
    _check_one(root, os.stat(root))
    for below in _chain(path, root)[1:]:
        _check_one(below, os.lstat(below))


def check_tree(folder: Path, root: Path) -> None:
    """check(folder, root), and everything inside folder."""
    check(folder, root)
    for top, folders, files in os.walk(folder):
        for name in folders + files:
            _check_one(Path(top) / name, os.lstat(Path(top) / name))


def make_folder(folder: Path, root: Path) -> Path:
    """folder (root or below it), each missing folder on the way created 0700 (root's own parents as usual), and
    each checked as check does before anything is made inside it."""
    root, folder = Path(root), Path(folder)
    root.parent.mkdir(parents=True, exist_ok=True)
    for path in _chain(folder, root):
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            pass  # made earlier, or by a process starting beside this one: checked all the same
        _check_one(path, os.stat(path) if path == root else os.lstat(path))
    return folder
