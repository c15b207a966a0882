"""A trial compile of each new constraint in a child process, which a timeout can kill.

xgrammar's compile cannot be interrupted: a thread running one past its time keeps a core, and every later compile
waits behind it. So a worker first compiles a new constraint in a child process, waits for its answer until the
constraint's deadline, and past it kills the child (the next compile starts a fresh one). Only a constraint whose
trial finished in time is compiled again in the worker, in about the same time, since a compile is deterministic.

The grammar itself does not come back: xgrammar's only serialization is JSON, which can be far larger and take far
longer than the compile itself. So each new constraint costs its compile twice (repeats come from the cache), and
each child start costs xgrammar's and torch's import (seconds of a core), counted against no constraint's timeout.

The child is started by subprocess (fork and exec at once: safe beside torch's threads) and talks over two pipes of
its own, in frames of a tag byte and a length. It ends when its request pipe closes, and with its parent.

compile_constraint is the compile itself, in the child or, for the offline engine, in process (grammars.py).
"""

import ctypes
import json
import os
import select
import struct
import subprocess
import sys
import time

from kvferry.common.child_python import python_command, python_env
from kvferry.common.constraint import CHOICE, GRAMMAR, JSON, REGEX, STRUCTURAL_TAG
from kvferry.common.errors import InvalidRequest

_HEADER = struct.Struct("!BQ")  # tag, payload length
READY, COMPILED, REFUSED = 0, 1, 2
SET_UP_TIMEOUT_S = 120.0  # the child's import and tokenizer info: far longer means a broken install, not a load
_MAX_FRAME_BYTES = 1 << 24  # a constraint's spec, xgrammar's refusal, or the tokenizer's info; only ever our own


class CompileTimedOut(Exception):
    """The compile ran past its deadline; the child that ran it is killed."""


class CompileProcessEnded(Exception):
    """The child died under a compile (the kernel's OOM killer, a crash): no fault of the constraint's shown yet."""


class CompileProcess:
    """The parent's end: one child at a time, started when first needed and again after a kill. One thread (the
    compile thread) calls everything but kill()."""

    def __init__(self, tokenizer_info_json: str):
        self._tokenizer_info = tokenizer_info_json.encode()
        self._proc: subprocess.Popen | None = None
        self._requests = self._answers = -1  # our ends of its pipes

    @property
    def pid(self) -> int | None:
        """The child's process id (the latest one, even once it has ended)."""
        return self._proc.pid if self._proc else None

    @property
    def running(self) -> bool:
        return self._requests >= 0 and self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """A fresh child, once it has set up (blocking: this is what a compile's clock does not count)."""
        self.close()
        requests_read, self._requests = os.pipe()
        self._answers, answers_write = os.pipe()
        child_fds = (requests_read, answers_write)
        try:
            self._proc = subprocess.Popen(
                python_command("-m", __name__, str(requests_read), str(answers_write)),
                env=python_env(),
                pass_fds=child_fds,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,  # its frames have pipes of their own: nothing a library prints gets in
            )
        finally:
            for fd in child_fds:
                os.close(fd)
        self._send(READY, self._tokenizer_info)
        tag, _ = self._receive(time.monotonic() + SET_UP_TIMEOUT_S)
        assert tag == READY, tag

    def compile(self, kind: str, spec: str, timeout_s: float | None) -> None:
        """Returns once the child compiled the constraint. InvalidRequest with xgrammar's reason when it refuses it;
        CompileTimedOut, the child killed, when no answer came within timeout_s."""
        if not self.running:
            self.start()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._send(COMPILED, json.dumps([kind, spec]).encode())
        tag, payload = self._receive(deadline)
        if tag == REFUSED:
            raise InvalidRequest(payload.decode())
        assert tag == COMPILED, tag

    def kill(self) -> None:
        """From any thread: the child ends, and a compile waiting on it with it."""
        proc = self._proc
        if proc is not None and proc.returncode is None:
            proc.kill()

    def close(self) -> None:
        """Kill the child (a compile under way with it) and let go of its pipes."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
        for fd in (self._requests, self._answers):
            if fd >= 0:
                os.close(fd)
        self._requests = self._answers = -1

    def _send(self, tag: int, payload: bytes) -> None:
        try:
            _write_frame(self._requests, tag, payload)
        except BrokenPipeError:
            self._ended()

    def _receive(self, deadline: float | None) -> tuple[int, bytearray]:
        tag, length = _HEADER.unpack(self._read(_HEADER.size, deadline))
        assert length <= _MAX_FRAME_BYTES, length
        return tag, self._read(length, deadline)

    def _read(self, size: int, deadline: float | None) -> bytearray:
        data = bytearray()
        while len(data) < size:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and (left <= 0 or not select.select([self._answers], [], [], left)[0]):
                self.close()
                raise CompileTimedOut()
            chunk = os.read(self._answers, min(size - len(data), 1 << 20))
            if not chunk:
                self._ended()
            data += chunk
        return data

    def _ended(self):
        """The child is gone (killed by close() of its owner, the kernel's OOM killer, a crash)."""
        code = self._proc.wait() if self._proc else None
        self.close()
        raise CompileProcessEnded(f"the compile process ended (exit status {code})")


def compile_constraint(compiler, kind: str, spec: str):
    """xgrammar's compile of one constraint; InvalidRequest with xgrammar's reason when it refuses it."""
    try:
        if kind == JSON:
            return compiler.compile_json_schema(spec, any_whitespace=False, strict_mode=True)
        if kind == REGEX:
            return compiler.compile_regex(spec)
        if kind == CHOICE:
            return compiler.compile_grammar(choice_grammar(spec))
        if kind == GRAMMAR:
            return compiler.compile_grammar(spec)
        assert kind == STRUCTURAL_TAG, kind
        return compiler.compile_structural_tag(spec)
    except InvalidRequest:
        raise
    except Exception as exc:  # xgrammar raises RuntimeError (and a few others) for what it cannot compile
        raise InvalidRequest(_reason(exc)) from None


def choice_grammar(spec: str) -> str:
    """A JSON array of strings -> an EBNF grammar matching exactly one of them."""
    try:
        choices = json.loads(spec)
    except ValueError:
        choices = None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise InvalidRequest("choice must be a non-empty list of strings")
    # A JSON string literal is an EBNF one too: the same escapes (\", \\, \n, \uXXXX).
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=True) for c in choices)


def _reason(exc: Exception) -> str:
    """xgrammar's message without its C++ source location: '[12:00:00] /project/cpp/x.cc:94: Regex ...'."""
    text = str(exc).strip()
    first, _, rest = text.partition(": ")
    return rest.strip() if rest and ".cc:" in first else text


def _write_frame(fd: int, tag: int, payload: bytes) -> None:
    view = memoryview(_HEADER.pack(tag, len(payload)) + payload)
    while view:
        view = view[os.write(fd, view) :]


def _read_exactly(fd: int, size: int) -> bytes | None:
    data = bytearray()
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def _die_with_parent() -> None:
    """Linux's parent-death signal: a worker killed outright does not leave its compile running. (It comes when
    the thread that started the child ends, which is the compile thread, ending only when the worker closes.)"""
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        pass


def give_back_memory() -> None:
    """glibc keeps the memory a large grammar's compile freed, tens of MiB beyond what the grammar holds, and would
    reuse it only for allocations that fit; handing it back keeps the process's RSS at its own size plus what it
    keeps. It takes well under a millisecond."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def main(requests: int, answers: int) -> None:
    _die_with_parent()
    header = _read_exactly(requests, _HEADER.size)
    info_json = header and _read_exactly(requests, _HEADER.unpack(header)[1])
    if info_json is None:
        return
    import xgrammar

    info = xgrammar.TokenizerInfo.deserialize_json(info_json.decode())
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    _write_frame(answers, READY, b"")
    while (header := _read_exactly(requests, _HEADER.size)) is not None:
        request = _read_exactly(requests, _HEADER.unpack(header)[1])
        if request is None:
            return  # the parent went mid-frame
        kind, spec = json.loads(request)
        try:
            compiled = compile_constraint(compiler, kind, spec)
            tag, payload = COMPILED, b""
        except InvalidRequest as exc:
            compiled, tag, payload = None, REFUSED, str(exc).encode()
        _write_frame(answers, tag, payload)
        del compiled  # a trial: the worker compiles it again
        give_back_memory()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
