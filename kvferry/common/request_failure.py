"""One request's failure stays with it: the rule every worker's loop follows, written once.

Whatever goes wrong while serving one request (a bad message, a bug in the code that handles it) ends that request
alone, with a 400 when the request asked for something that can never be served and a 500 when the server failed
it; the worker goes on with the others. Only a FatalError (a broken device) ends the process.
"""

import contextlib
from collections.abc import Callable, Iterator

from kvferry.common.errors import FatalError, InvalidRequest


def failure_code(exc: BaseException | None) -> int:
    """The status a request's failure gets: 400 for what the request got wrong (InvalidRequest), 500 for the rest."""
    return 400 if isinstance(exc, InvalidRequest) else 500


def failure_text(exc: BaseException) -> str:
    """How a failure reads in the request's error: the exception's type and message."""
    return f"{type(exc).__name__}: {exc}"


@contextlib.contextmanager
def fails_alone(on_failure: Callable[[Exception], object]) -> Iterator[None]:
    """Run the block for one request (or one unit of a loop's work): an Exception it raises is that request's
    alone, handed to on_failure, and the caller goes on after the block. A FatalError goes through, as does a
    BaseException (KeyboardInterrupt, SystemExit); so does whatever on_failure raises.

    on_failure runs while the exception is being handled: log.exception in it logs the traceback."""
    try:
        yield
    except FatalError:
        raise
    except Exception as exc:
        on_failure(exc)
