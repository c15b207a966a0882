"""Compile a C kernel for this machine once, and load it with ctypes.

Built with `$CC` (else `cc`) for the host's own instruction set, under a name that hashes the source, the flags, the
compiler and the CPU's feature flags: another machine or compiler gets its own build. No torch headers are needed;
it links libgomp, which torch has loaded, so the kernel's threads are torch's OpenMP threads. The build folder and
library must be this user's alone (kvferry.cache_trust): one someone else could have written is refused, loudly.
"""

import contextlib
import ctypes
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

from kvferry.cache_trust import check, make_folder

log = logging.getLogger("kvferry.kernels")

FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=gnu11", "-shared", "-fPIC", "-Wall")


def cpu_features() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    return ""


def build(source: Path, build_dir: Path, extra_flags: tuple[str, ...] = ()) -> Path:
    """The library of source for this machine, compiled into build_dir (made 0700) unless there already."""
    compiler = shlex.split(os.environ.get("CC") or "cc")
    flags = (*FLAGS, *extra_flags)
    version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    executable = os.path.realpath(shutil.which(compiler[0]) or compiler[0])  # cc is a link to the compiler it runs
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]  # what the source may include
    identity = [source.read_text(), *headers, *flags, shlex.join(compiler), executable, version, cpu_features()]
    key = hashlib.sha256("\0".join(identity).encode()).hexdigest()
    make_folder(build_dir, build_dir)
    target = build_dir / f"{source.stem}-{key[:16]}.so"
    if target.exists():
        check(target, build_dir)
        return target
    # Compile to a temporary name, then rename: processes starting together never load a half-written file.
    fd, partial = tempfile.mkstemp(suffix=".so", dir=build_dir)
    os.close(fd)
    try:
        subprocess.run([*compiler, *flags, "-o", partial, str(source), "-lm"], capture_output=True, text=True,
                       timeout=300, check=True)  # fmt: skip
        os.chmod(partial, 0o700)  # the linker made it as the umask says, which may let the group write it
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def load(source: Path, build_dir: Path, extra_flags: tuple[str, ...] = ()) -> tuple[ctypes.CDLL | None, str]:
    """(the loaded library, "") or (None, why not): a missing or failing compiler is not an error, the caller
    keeps its PyTorch path; an untrusted build folder or library is (UntrustedCache)."""
    try:
        return ctypes.CDLL(str(build(source, build_dir, extra_flags))), ""
    except subprocess.CalledProcessError as e:
        return None, f"{shlex.join(e.cmd)} failed: {(e.stderr or e.stdout or '').strip()[-500:]}"
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{type(e).__name__}: {e}"


class Library:
    """A kernel module's C library in this process: enable() loads it, disable() goes back to `fallback` (the PyTorch
    path; tests and benchmarks compare the two). Once loaded, each function in signatures (name -> (argument types,
    result type)) is an attribute; on_load(library) reads what the library says of itself."""

    def __init__(self, source: Path, signatures: dict, fallback: str, flags: tuple[str, ...] = (), on_load=None):
        self.source, self.signatures, self.fallback = source, signatures, fallback
        self.flags, self.on_load = flags, on_load
        self.loaded: ctypes.CDLL | None = None

    def enable(self, build_dir: Path) -> str:
        """Compile (once per machine) and load; returns "" or why the fallback stays in use."""
        if self.loaded is None:
            lib, why = load(self.source, build_dir, self.flags)
            if lib is None:
                log.warning("%s stays in use: %s", self.fallback, why)
                return why
            for name, (argtypes, restype) in self.signatures.items():
                function = getattr(lib, name)
                function.argtypes, function.restype = argtypes, restype
                setattr(self, name, function)
            self.loaded = lib
            if self.on_load is not None:
                self.on_load(self)
        return ""

    def disable(self) -> None:
        self.loaded = None
        for name in self.signatures:
            self.__dict__.pop(name, None)
