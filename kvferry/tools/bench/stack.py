"""A fresh stack on free ports for benchmarks that compare settings: each side gets processes of its own."""

import contextlib
import json
import os
import urllib.request

from kvferry.common import settings
from kvferry.services.launcher import free_port, start_services, stop_all

# Settings the stacks of one comparison must not inherit from the caller's environment.
COMPARED_SETTINGS = tuple(
    settings.env_name(name)
    for name in ("trace_dir", "capture_dir", "otlp_endpoint", "no_prefix_caching", "no_chunked_prefill")
)


@contextlib.contextmanager
def fresh_stack(
    model: str | None,
    env: dict | None = None,
    num_prefill: int = 1,
    num_decode: int = 1,
    prefill_threads: int = 1,
    decode_threads: int = 1,
):
    """Yields the gateway's URL of a new gateway and workers, stopped on exit."""
    full_env = {k: v for k, v in os.environ.items() if k not in COMPARED_SETTINGS}
    full_env.update(env or {})
    if model:
        full_env[settings.env_name("model")] = model
    port = free_port()
    procs = start_services(
        "127.0.0.1", port, free_port(), prefill_threads, decode_threads, full_env, num_prefill, num_decode
    )
    try:
        yield f"http://127.0.0.1:{port}", procs
    finally:
        stop_all(procs)


def served_model(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        return json.loads(r.read())["data"][0]["id"]
