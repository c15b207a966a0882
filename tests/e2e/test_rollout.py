"""A gateway rollout as the Kubernetes manifests do it (strategy Recreate): the old gateway drains and exits,
a new one takes the same address, and the running workers register with it on their own."""

import signal

import pytest

pytestmark = pytest.mark.slow
BODY = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}


def test_workers_register_with_the_gateway_that_replaces_theirs(make_stack):
    stack = make_stack().start_pair()
    status, before = stack.post("/v1/completions", BODY)
    assert status == 200
    old_id = stack.get("/v1/workers")[1]["gateway"]["id"]
    assert stack.stop("gateway", sig=signal.SIGTERM) == 0  # drained: nothing in flight
    stack.start_gateway()
    stack.wait_for(lambda: stack.get("/health")[0] == 200, 60, "the workers to register with the new gateway")
    assert stack.get("/v1/workers")[1]["gateway"]["id"] != old_id
    assert set(stack.workers()) == {"prefill-a", "decode-a"}
    assert stack.procs["prefill-a"].poll() is None and stack.procs["decode-a"].poll() is None
    status, after = stack.post("/v1/completions", BODY)
    assert status == 200 and after["choices"][0]["text"] == before["choices"][0]["text"]
