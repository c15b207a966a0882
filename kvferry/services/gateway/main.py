"""`kvferry gateway`: the HTTP API and the worker registry, in one asyncio process. On SIGTERM it drains: new
requests and /health get 503, those in flight finish within --drain-timeout; a second SIGTERM, or Ctrl-C, stops at once
(a repeat within a second of the first is its echo, and changes nothing: stop_signals.py).
"""

import asyncio
import logging
import signal
import time

import uvicorn

from kvferry.common import settings
from kvferry.common.bind_check import check_http_exposed, listen_tcp
from kvferry.common.curve import CurveKeys
from kvferry.common.gateway_config import GatewayConfig
from kvferry.common.model_files import (
    DEFAULT_MODEL_NAME,
    max_model_len_of,
    read_config,
    resolve_model,
    served_model_name,
)
from kvferry.common.setting import from_args
from kvferry.common.startup_heap import collect_less_often, freeze_startup_objects
from kvferry.common.text_tokenizer import TextTokenizer
from kvferry.services.gateway.api import Api
from kvferry.services.gateway.capture import CaptureLimits, CaptureWriter
from kvferry.services.gateway.server import Deadlines, GatewayCore
from kvferry.services.gateway.tool_prompt import ToolPrompt
from kvferry.services.stop_signals import StopSignals

log = logging.getLogger("kvferry.gateway")
# The default model's own id on the Hugging Face Hub, where its tokenizer resolves (the GGUF it ships as is a
# quantization of it).
DEFAULT_MODEL_SOURCE = "HuggingFaceTB/SmolLM2-135M-Instruct"


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, core: GatewayCore, drain_timeout_s: float):
        super().__init__(config)
        self.core, self.drain_timeout_s = core, drain_timeout_s
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stops = StopSignals()

    async def startup(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig, frame) -> None:
        if self.stops.is_echo(sig):  # the group's signal and our parent's copy of it: one stop
            return
        if sig == signal.SIGTERM and not self.core.draining and self.loop is not None:
            self.core.draining = True
            self.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.drain()))
            return
        super().handle_exit(sig, frame)

    async def drain(self) -> None:
        log.info("draining: %d requests in flight, at most %.0f s", len(self.core.flights), self.drain_timeout_s)
        give_up_at = self.loop.time() + self.drain_timeout_s
        while self.core.flights and self.loop.time() < give_up_at:
            await asyncio.sleep(0.1)
        if self.core.flights:
            log.warning("drain timed out with %d requests in flight", len(self.core.flights))
        self.should_exit = True


def load_text_side(model) -> tuple[TextTokenizer, int]:
    """What the gateway knows of the model: its tokenizer with the chat template, and its length limit. Without
    torch, nor transformers, which imports it."""
    model_dir = resolve_model(model)
    tokenizer = TextTokenizer(model_dir)
    if not tokenizer.generic:
        log.warning(
            "%s's tokenizer_class is %s: transformers rebuilds that one's pipeline, while the gateway encodes with "
            "tokenizer.json as saved; the two may differ",
            model_dir,
            tokenizer.tokenizer_class,
        )
    return tokenizer, max_model_len_of(read_config(model_dir))


def served_names(model, configured: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """The names the API serves the model under, the first the one responses report: --served-model-name's, else
    the model's own name; for the default model, its Hugging Face id first (benchmark clients such as guidellm load
    the tokenizer by the served name) and its short name after it, which clients have always sent."""
    if configured:
        return tuple(configured)
    if model is None or str(model) == "":
        return DEFAULT_MODEL_SOURCE, DEFAULT_MODEL_NAME
    return (served_model_name(model),)


def run_gateway(args) -> None:
    from kvferry.common.tracing import observe

    config = from_args(GatewayConfig, args)
    index = getattr(args, "gateway_index", None)  # one of --gateways N processes (gateway_group.py starts them)
    observe(args, "gateway", "gateway" if index is None else f"gateway-{index}")
    check_http_exposed(config.host, config.port, config.api_key, args.insecure)
    # Bound before the model loads: a taken port fails at once, naming the setting. One of several processes binds
    # a socket of its own on the shared port, with SO_REUSEPORT.
    http_socket = listen_tcp(config.host, config.port, settings.label("port"), reuse_port=config.gateways > 1)
    name = served_model_name(args.model)  # what workers register with; clients may know it by other names
    core = GatewayCore(
        config.control,
        name,
        args.block_size,
        config.heartbeat_interval,
        Deadlines(config),
        CurveKeys.load(args.curve_keys),
        insecure=args.insecure,
    )  # binds --control: before the tokenizer loads, too
    tokenizer, model_max_len = load_text_side(args.model)
    loaded_at = time.time()  # /v1/models' created
    names = served_names(args.model, config.served_model_name)
    tool_prompt = ToolPrompt.from_file(config.tool_prompt_template)  # a template that does not render stops us here
    capture = None
    if config.capture_dir:
        limits_of_files = CaptureLimits(config.capture_max_bytes, config.capture_max_total_bytes)
        capture = CaptureWriter(config.capture_dir, core.gateway_id, limits_of_files, (config.api_key,))
        log.info("capturing every finished request into %s", config.capture_dir)
    api = Api(
        core,
        tokenizer,
        names,
        args.max_model_len or model_max_len,
        config,
        tool_prompt,
        capture,
        loaded_at=loaded_at,
        gateway_index=index,
    )
    log.info(
        "serving %s as %s on http://%s:%d, workers register at %s%s",
        name,
        ", ".join(names),
        config.host,
        config.port,
        core.control_endpoint,
        "" if index is None else f" (gateway {core.gateway_id}, process {index + 1} of {config.gateways})",
    )
    # log_config=None: uvicorn's own lines go through our handler (and its JSON format). Past limit_concurrency
    # connections (or requests at once) uvicorn answers 503 at once: a flood of clients costs a refusal each, not
    # memory. A request's head is bounded by h11's own limit (16 KiB), and its body by the Guards.
    uvicorn_config = uvicorn.Config(
        api.app(),
        host=config.host,
        port=config.port,
        log_level="warning",
        log_config=None,
        timeout_graceful_shutdown=5,
        limit_concurrency=config.max_connections,
    )
    server = DrainingServer(uvicorn_config, core, args.drain_timeout)
    freeze_startup_objects()  # the app, tokenizer and template: a full collection mid-stream would walk them all
    collect_less_often()
    server.run(sockets=[http_socket])
