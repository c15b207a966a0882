"""The gateway's HTTP API in process, over a core with no workers (unless a test registers some): for tests of
what the API does before and after the workers, without processes."""

import contextlib

MODEL = "SmolLM2-135M-Instruct"


@contextlib.contextmanager
def in_process_api(limits=None):
    """An Api with the default model's tokenizer over a GatewayCore bound to a free loopback port, closed after."""
    from kvferry.services.gateway.api import Api
    from kvferry.services.gateway.main import load_text_side
    from kvferry.services.gateway.server import GatewayCore

    core = GatewayCore("tcp://127.0.0.1:0", MODEL, 16)
    try:
        yield Api(core, load_text_side(None)[0], MODEL, 2048, limits)
    finally:
        core.control.socket.close()
