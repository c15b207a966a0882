"""A stop signal's echo (a process group's signal, passed on again by the parent) told from a second signal."""

import signal
import time

from kvferry.services import stop_signals
from kvferry.services.stop_signals import StopSignals


def test_a_repeat_within_the_window_is_the_same_stop_and_a_later_one_or_another_signal_is_not(monkeypatch):
    monkeypatch.setattr(stop_signals, "SAME_STOP_S", 0.5)
    stops = StopSignals()
    assert not stops.is_echo(signal.SIGTERM)  # the first: a drain
    assert stops.is_echo(signal.SIGTERM)  # the parent's copy of it
    assert not stops.is_echo(signal.SIGINT)  # Ctrl-C after it: a stop of its own
    time.sleep(0.6)
    assert not stops.is_echo(signal.SIGTERM)  # a second stop: at once
