"""Fuzzing the decoder: whatever bytes arrive, decoding raises ProtocolError or returns a valid message; nothing
else escapes. 4,000 + 3,000 + 2 x 3,000 examples: over 10,000 frames. The live sockets get theirs in
tests/e2e/test_reliability.py."""

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvferry.common import protocol as p
from kvferry.common.sampling import SamplingParams

pytestmark = pytest.mark.slow  # seconds of work: `make check` leaves it to `make test`

SAMPLING = SamplingParams(
    max_tokens=8, temperature=0.0, top_p=1.0, top_k=0, seed=None, ignore_eos=False, stop_token_ids=(2,)
)
VALID = [
    p.encode(m, "r")
    for m in (
        p.Abort(),
        p.Tokens([1, 2], start=3),
        p.Heartbeat("w", p.WorkerStats(1, 2, 3, 4, 5)),
        p.PrefillRequest([1, 2, 3], SAMPLING, "d", "tcp://x:1", 1.0),
    )
]

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


def check(parts) -> None:
    try:
        env = p.decode(parts)
    except p.ProtocolError:
        return
    assert type(env.message) in p.MESSAGES.values()


@settings(max_examples=4000, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.binary(max_size=64), max_size=3))
def test_random_bytes(parts):
    check(parts)


@settings(max_examples=3000, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(range(len(VALID))), st.integers(0, 200), st.binary(min_size=1, max_size=4), st.booleans())
def test_mutated_and_truncated_valid_messages(which, at, patch, truncate):
    header = VALID[which][0]
    at = at % len(header)
    mutated = header[:at] if truncate else header[:at] + patch + header[at + len(patch) :]
    check([mutated])


@settings(max_examples=3000, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(0, 20), st.integers(-3, 8), msgpack_values, msgpack_values, msgpack_values)
def test_well_formed_msgpack_with_wrong_content(kind, version, request_id, trace, body):
    check([msgpack.packb([kind, version, request_id, trace, body])])
    check([msgpack.packb([kind, p.PROTOCOL_VERSION, "r", {}, body])])
