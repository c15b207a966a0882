"""What a test needs of the machine beyond the package: Prometheus, network namespaces, the `.venv` that
`make install` creates. Run alone without it, such a test skips and says what is missing. `make test` provides all
of it and says so (KVFERRY_TESTS_REQUIRE_ENV=1): there the test fails instead, so that a CI that lost a piece of its
environment cannot pass by skipping what it promised to run."""

import os
from typing import NoReturn

import pytest

REQUIRED = os.environ.get("KVFERRY_TESTS_REQUIRE_ENV") == "1"


def lacking(reason: str) -> NoReturn:
    """Skip for want of `reason`, or fail where the environment was promised."""
    if REQUIRED:
        pytest.fail(f"`make test` provides this, but: {reason}", pytrace=False)
    pytest.skip(reason)
