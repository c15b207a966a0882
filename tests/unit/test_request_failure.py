"""fails_alone: a request's exception goes to its handler and the loop goes on; a FatalError ends the caller."""

import logging

import pytest

from kvferry.common.errors import FatalError, InvalidRequest
from kvferry.common.request_failure import fails_alone, failure_code, failure_text

log = logging.getLogger("test.request_failure")


def serve(requests, on_failure):
    """A worker loop in small: each request is a callable; returns what the loop went on to do after each."""
    served = []
    for request in requests:
        with fails_alone(on_failure):
            request()
        served.append(request.__name__)
    return served


def ok():
    pass


def bad_request():
    raise InvalidRequest("n must be at least 1")


def bug():
    raise KeyError("a bug")


def broken_device():
    raise FatalError("the device failed")


def test_each_failure_goes_to_its_handler_with_its_code_and_the_loop_goes_on():
    failures = []
    served = serve([bad_request, ok, bug, ok], lambda exc: failures.append((failure_code(exc), failure_text(exc))))
    assert served == ["bad_request", "ok", "bug", "ok"]
    assert failures == [(400, "InvalidRequest: n must be at least 1"), (500, "KeyError: 'a bug'")]


def test_a_fatal_error_ends_the_loop_unhandled():
    failures = []
    with pytest.raises(FatalError, match="device failed"):
        serve([ok, broken_device, ok], failures.append)
    assert failures == []


def test_an_interrupt_is_not_a_request_failure():
    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        serve([interrupted], lambda exc: None)


def test_the_handler_logs_the_traceback_and_may_end_the_caller(caplog):
    def give_up(exc):
        log.exception("while serving")
        raise FatalError("too many failures") from exc

    with caplog.at_level(logging.ERROR, logger=log.name), pytest.raises(FatalError) as raised:
        serve([bug], give_up)
    [record] = caplog.records
    assert record.exc_info[0] is KeyError and "in bug" in caplog.text  # the failing frame, from the traceback
    assert isinstance(raised.value.__cause__, KeyError)


def test_without_an_exception_code_is_500():
    assert failure_code(None) == 500
