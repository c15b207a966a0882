"""Open by default nowhere, on real processes: a gateway (or `kvferry serve`) that would listen on every interface
without an API key exits 2 with one line that says how to fix it; with --api-key, or --insecure, it starts."""

import subprocess
import sys

import pytest

from tests.e2e.stack import Stack
from tests.tiny_models import save_tiny_chat_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("model") / "tiny-chat"
    save_tiny_chat_model(folder)
    return str(folder)


def refusal(*args: str, env: dict) -> str:
    """The one error line of a kvferry command that must exit 2 at once; a command still running has started."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", "kvferry.tools.cli", *args], capture_output=True, text=True, timeout=60, env=env
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"kvferry {' '.join(args)} started, listening beyond loopback without an API key")
    assert done.returncode == 2, done.stderr[-2000:]
    [line] = [line for line in done.stderr.splitlines() if line.startswith("kvferry: error:")]
    return line


def test_a_gateway_on_every_interface_needs_an_api_key_or_insecure(make_stack, tiny):
    stack: Stack = make_stack(model=tiny)
    env = {k: v for k, v in stack.env.items() if k != "KVFERRY_API_KEY"}
    open_gateway = ("gateway", "--host", "0.0.0.0", "--port", str(stack.port), "--control", stack.control)
    for args in (open_gateway, ("serve", "--host", "0.0.0.0", "--port", str(stack.port))):
        line = refusal(*args, env=env)
        for fix in (f"0.0.0.0:{stack.port}", "--api-key (KVFERRY_API_KEY)", "--insecure (KVFERRY_INSECURE)"):
            assert fix in line, (fix, line)
    # With a key it listens, and asks for the key.
    stack.start("gateway", *open_gateway, env={"KVFERRY_API_KEY": "e2e-key"})
    stack.wait_for(lambda: stack.get("/version")[0] == 200, 120, "the gateway with a key to listen")
    assert stack.get("/v1/models")[0] == 401
    assert stack.stop("gateway", timeout=60) is not None
    # --insecure (on a private network) starts it without a key, with a loud warning.
    stack.start("gateway", *open_gateway, "--insecure", env=env)
    stack.wait_for(lambda: stack.get("/v1/models")[0] == 200, 120, "the insecure gateway to listen")
    assert "INSECURE (--insecure (KVFERRY_INSECURE))" in stack.log("gateway")
