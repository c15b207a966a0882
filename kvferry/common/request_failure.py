"""One request's failure stays with it: the rule every worker's loop follows, written once.

Whatever goes wrong while serving one request (a bad message, a bug in the code that handles it) ends that request
alone, with a 400 when the request asked for something that can never be served and a 500 when the server failed
it; the worker goes on with the others. Only a FatalError (a broken device) ends the process.
"""

from collections.abc import Callable

from kvferry.common.errors import FatalError, InvalidRequest


def failure_code(exc: BaseException | None) -> int:
    """The status a request's failure gets: 400 for what the request got wrong (InvalidRequest), 500 for the rest."""
    return 400 if isinstance(exc, InvalidRequest) else 500


def failure_text(exc: BaseException) -> str:
    """How a failure reads in the request's error: the exception's type and message."""
    return f"{type(exc).__name__}: {exc}"


class fails_alone:  # lower case: a context manager, named as the function it was
    """Run the block for one request (or one unit of a loop's work): an Exception it raises is that request's
    alone, handed to on_failure, and the caller goes on after the block. A FatalError goes through, as does a
    BaseException (KeyboardInterrupt, SystemExit); so does whatever on_failure raises.

    on_failure runs while the exception is being handled: log.exception in it logs the traceback. A class, not a
    generator: contextlib's costs three times as much, and a decode step enters one per sequence."""

    __slots__ = ("on_failure",)

    def __init__(self, on_failure: Callable[[Exception], object]):
        self.on_failure = on_failure

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, traceback) -> bool:
        if kind is None or not issubclass(kind, Exception) or issubclass(kind, FatalError):
            return False
        self.on_failure(exc)
        return True
