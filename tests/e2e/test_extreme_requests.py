"""Requests the API schema allows, with extreme values, against a real gateway and a real prefill/decode pair:
each is served (a 200 with every choice it asked for), never refused, failed or hung, and no process exits."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvferry.common.sampling import MAX_SEED
from tests.e2e.stack import tiny_stack

VOCAB = 49152  # the default tokenizer's, which the tiny chat model shares


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with tiny_stack(tmp_path_factory.mktemp("extreme")) as stack:
        yield stack.start_pair()


bias = st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.sampled_from([-100, -99.5, 0, 100]), max_size=8)
requests = st.fixed_dictionaries(
    {
        "prompt": st.sampled_from(["hi", "The quick brown fox", "1 2 3 4 5 6 7 8", " "]),
        "max_tokens": st.sampled_from([1, 2, 8]),
    },
    optional={
        "n": st.integers(1, 4),
        "seed": st.one_of(st.integers(MAX_SEED - 4, MAX_SEED), st.integers(0, 3)),
        "temperature": st.sampled_from([0.0, 1e-6, 1.0, 2.0]),
        "top_p": st.sampled_from([1e-9, 0.5, 1.0]),
        "top_k": st.sampled_from([-1, 0, 1, 2**31 - 1]),
        "min_p": st.sampled_from([0.0, 1.0]),
        "presence_penalty": st.sampled_from([-2.0, 2.0]),
        "frequency_penalty": st.sampled_from([-2.0, 2.0]),
        "repetition_penalty": st.sampled_from([1e-3, 2.0]),
        "logit_bias": bias,
        "logprobs": st.sampled_from([0, 5]),
        "echo": st.booleans(),
        "ignore_eos": st.booleans(),
        # Stop strings that match at the first token: every letter, space and digit.
        "stop": st.sampled_from([[" "], list("etaoinshr"), list("0123"), ["\n"]]),
    },
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=requests, min_equals_max=st.booleans())
def test_extreme_but_valid_requests_are_served_and_no_process_exits(stack, body, min_equals_max):
    if min_equals_max:
        body = {**body, "min_tokens": body["max_tokens"]}
    status, reply = stack.post("/v1/completions", body, timeout=120)
    assert status == 200 and len(reply["choices"]) == body.get("n", 1), (status, reply, body)
    assert all(proc.poll() is None for proc in stack.procs.values()), body
