"""`kvferry gateway`: the HTTP API and the worker registry, in one asyncio process."""
import logging

from kvferry.common.model.loader import max_model_len_of, resolve_model, served_model_name
from kvferry.services.gateway.api import Api
from kvferry.services.gateway.server import GatewayCore


def run_gateway(model: str | None, host: str, port: int, control: str, block_size: int,
                heartbeat_interval_s: float, max_model_len: int | None) -> None:
    import uvicorn
    from transformers import AutoConfig, AutoTokenizer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    model_dir = resolve_model(model)
    hf_config = AutoConfig.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    name = served_model_name(model)
    core = GatewayCore(control, name, block_size, heartbeat_interval_s)
    api = Api(core, tokenizer, name, max_model_len or max_model_len_of(hf_config))
    logging.getLogger("kvferry.gateway").info("serving %s on http://%s:%d, workers register at %s", name, host, port,
                                              core.control_endpoint)
    uvicorn.run(api.app(), host=host, port=port, log_level="warning")
