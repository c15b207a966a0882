"""`kvferry gateway`: the HTTP API and the worker registry, in one asyncio process."""
import logging

from kvferry.common.model.loader import max_model_len_of, resolve_model, served_model_name
from kvferry.services.gateway.api import Api
from kvferry.services.gateway.request_parsing import Limits
from kvferry.services.gateway.server import GatewayCore


def run_gateway(args) -> None:
    import uvicorn
    from transformers import AutoConfig, AutoTokenizer

    from kvferry.services.cli import observe

    observe(args, "gateway", "gateway")
    model_dir = resolve_model(args.model)
    hf_config = AutoConfig.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    name = served_model_name(args.model)
    core = GatewayCore(args.control, name, args.block_size, args.heartbeat_interval)
    limits = Limits(max_body_bytes=args.max_body_size, max_n=args.max_n, max_tokens=args.max_tokens_limit,
                    max_stop=args.max_stop, max_prompts=args.max_prompts)
    api = Api(core, tokenizer, name, args.max_model_len or max_model_len_of(hf_config), limits, args.api_key)
    logging.getLogger("kvferry.gateway").info("serving %s on http://%s:%d, workers register at %s", name, args.host,
                                              args.port, core.control_endpoint)
    # log_config=None: uvicorn's own lines go through our handler (and its JSON format).
    uvicorn.run(api.app(), host=args.host, port=args.port, log_level="warning", log_config=None)
