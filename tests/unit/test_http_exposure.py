"""Open by default nowhere: the HTTP API bound beyond loopback without an API key refuses to start, unless --insecure
says that the network is private (then a loud warning), as the ZeroMQ binds without CURVE do."""

import logging

import pytest

from kvferry.common.bind_check import check_http_exposed
from kvferry.common.errors import ConfigError

LOCAL = ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost")
EXPOSED = ("0.0.0.0", "", "::", "10.1.2.3", "gateway.example", "127.evil.example")


def test_the_http_api_on_loopback_needs_no_key():
    for host in LOCAL:
        check_http_exposed(host, 8000, api_key=None)


def test_the_http_api_beyond_loopback_without_a_key_is_refused_naming_the_fixes():
    for host in EXPOSED:
        with pytest.raises(ConfigError) as refused:
            check_http_exposed(host, 8000, api_key=None)
        message = str(refused.value)
        assert "\n" not in message and f"{host}:8000" in message, message
        for fix in ("--api-key (KVFERRY_API_KEY)", "--host (KVFERRY_HOST)", "--insecure (KVFERRY_INSECURE)"):
            assert fix in message, (fix, message)
        with pytest.raises(ConfigError):
            check_http_exposed(host, 8000, api_key="")  # an empty key is no key


def test_a_key_or_insecure_lets_it_listen_beyond_loopback(caplog):
    for host in EXPOSED:
        check_http_exposed(host, 8000, api_key="k")
        with caplog.at_level(logging.WARNING, logger="kvferry.transport"):
            check_http_exposed(host, 8000, api_key=None, insecure=True)
        record = caplog.records[-1]
        assert record.levelno == logging.WARNING and "INSECURE (--insecure (KVFERRY_INSECURE))" in record.getMessage()
