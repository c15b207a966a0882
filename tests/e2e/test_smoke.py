"""The end-to-end smoke test of `make check`: a tiny-model stack of one prefill and one decode worker answers a
greedy request with the in-process engine's text, and a stream whose decode worker is killed goes on on another
one and ends with the same text. Real processes, real sockets, real HTTP; a few seconds."""

import concurrent.futures

from tests.e2e.stack import engine_texts, tiny_stack

PROMPT = "Once upon a time, in a land of rivers,"
GREEDY = {"max_tokens": 48, "temperature": 0, "ignore_eos": True}
# Steps slowed to the default model's pace, so that a kill lands mid-stream; failover quick.
ENV = {"KVFERRY_FAULTS": "step_delay_ms=30", "KVFERRY_STEP_TIMEOUT": "10", "KVFERRY_FIRST_TOKEN_TIMEOUT": "30"}


def test_a_tiny_stack_equals_the_engine_and_a_killed_decode_workers_stream_goes_on(tmp_path):
    with tiny_stack(tmp_path, extra_env=ENV) as stack:
        stack.start_pair(decode="decode-a")
        [want] = engine_texts([PROMPT], model=stack.env["KVFERRY_MODEL"], **GREEDY)
        status, reply = stack.post("/v1/completions", {"prompt": PROMPT, **GREEDY})
        assert status == 200 and reply["choices"][0]["text"] == want, reply
        # The other decode worker's cache is smaller: the gateway routes to decode-a while both live.
        stack.start_worker("decode-b", "decode", env={"KVFERRY_KV_CACHE_MEMORY": "8MiB"})
        stack.wait_workers({"decode-b"})
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            stream = pool.submit(stack.stream, "/v1/completions", {"prompt": PROMPT, **GREEDY}, 120)
            stack.wait_for(lambda: stack.workers()["decode-a"].get("requests_in_flight", 0) == 1, 30, "the stream")
            stack.stop("decode-a")  # SIGKILL, mid-stream
            events = stream.result(timeout=120)
        assert events[-1] == "[DONE]" and not [e for e in events[:-1] if "error" in e], events[-3:]
        assert "".join(c["text"] for e in events[:-1] for c in e["choices"]) == want
        assert stack.get("/v1/workers")[1]["gateway"]["moves"] >= 1  # the kill came mid-stream: it moved
