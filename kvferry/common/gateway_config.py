"""The gateway's settings (GatewayConfig), each declared once as a field: its default, bounds and help. `kvferry
gateway` takes them all, and `kvferry serve` all but --control (serve's --control-port picks it) and --heartbeat-interval
(serve's gateway reads its variable)."""

from kvferry.common.peer_address import MAX_PORT
from kvferry.common.setting import GATEWAY, NAMES, PATH, SERVE, SIZE, setting, settings_class

_GATEWAY_ONLY = (GATEWAY,)
MAX_GATEWAYS = 64  # each process holds the tokenizer and a link to every worker: more than cores gains nothing


@settings_class((GATEWAY, SERVE), "gateway")
class GatewayConfig:
    host: str = setting("127.0.0.1", "the HTTP API's address (0.0.0.0: every interface)")
    port: int = setting(8000, "the HTTP API's port", min=0, max=MAX_PORT)
    # More than one: the HTTP side's parsing, detokenizing and streaming spread over cores (common/gateway_ports.py).
    gateways: int = setting(
        1,
        "gateway processes sharing the HTTP port (the kernel spreads new connections over them); each takes a control "
        "port of its own, --control's (or serve's --control-port) and those after it, and every worker registers "
        "with all of them",
        min=1,
        max=MAX_GATEWAYS,
    )
    control: str = setting(
        "tcp://127.0.0.1:5557",
        "where workers register (beyond 127.0.0.1 only with --curve-keys, or --insecure)",
        commands=_GATEWAY_ONLY,
    )
    heartbeat_interval: float = setting(
        "1.0",
        "seconds between a worker's heartbeats (the gateway tells each worker as it registers); a worker that "
        "misses several is taken off the registry",
        above=0,
        commands=_GATEWAY_ONLY,
    )
    max_waiting: int = setting(
        256,
        "requests waiting for their first token; past this, new ones get 429 (0: no bound)",
        min=0,
        section="deadlines and overload",
    )
    max_waiting_bytes: int = setting(
        "64MiB",
        "request bodies let in and not yet answered, in bytes as sent (parsed, they take about 11 times that); past "
        "this, new ones get 429 (0: no bound). A lone request is always let in",
        kind=SIZE,
        min=0,
    )
    first_token_timeout: float = setting(
        120, "a request without its first token this long moves to other workers", above=0
    )  # routed -> first token: queueing plus prefill
    step_timeout: float = setting(
        30, "a decoding request without new tokens this long moves to other workers", above=0
    )  # between a decoding request's token messages
    request_timeout: float = setting(
        600, "a request not finished this long after it arrived fails with 504", above=0
    )  # end to end
    max_moves: int = setting(3, "how often a request may move off a failed worker before it fails", min=0)
    api_key: str | None = setting(
        None,
        "require 'Authorization: Bearer KEY' on every route but /health, /metrics, /version, /openapi.json",
        section="API",
    )
    served_model_name: tuple[str, ...] | None = setting(
        None,
        "the model's names in the API, as vLLM's flag: the first is the one responses report, a request may name "
        "any, /v1/models lists them all; default: the model's own name (the default model's is "
        "HuggingFaceTB/SmolLM2-135M-Instruct, also answering to SmolLM2-135M-Instruct). The variable takes them "
        "separated by spaces",
        kind=NAMES,
    )
    max_body_size: int = setting("8MiB", "larger request bodies get 413", kind=SIZE, min=1)
    max_n: int = setting(16, "the largest n a request may ask for", min=1)
    max_tokens_limit: int = setting(16384, "the largest max_tokens a request may ask for", min=1)
    max_stop: int = setting(16, "the most stop strings a request may send", min=0)
    max_prompts: int = setting(64, "the most prompts one completions request may carry", min=1)
    max_stop_length: int = setting(1024, "the longest stop string, in characters", min=1)
    max_stop_chars: int = setting(4096, "the most characters a request's stop strings may have together", min=1)
    max_prompt_chars: int = setting(
        1000000, "the most characters a request's prompts (or chat messages) may have together", min=1
    )
    max_logprob_entries: int = setting(
        1000000,
        "the most logprob entries one response may hold: n x (echoed prompt tokens + max_tokens) x (1 + logprobs), "
        "over every prompt (streamed: the echoed prompts alone); past this, 400 before any work",
        min=1,
    )
    max_connections: int = setting(1024, "HTTP connections served at once; past this, new ones get 503", min=1)
    tool_prompt_template: str | None = setting(
        None,
        "a Jinja file that renders chat tools into the system prompt for models whose chat template has no tools; "
        "default: kvferry's own (docs/structured-output.md)",
        kind=PATH,
        metavar="FILE",
    )
    capture_dir: str | None = setting(
        None,
        "append one JSON line per finished request to files in this folder, for kvferry replay, simulate and plan "
        "(prompts and outputs included: keep the folder as private as the traffic)",
        kind=PATH,
        section="observability",
    )
    capture_max_bytes: int = setting(
        "64MiB", "a capture file past this size is closed and a new one started", kind=SIZE, min=4096
    )
    capture_max_total_bytes: int = setting(
        "1GiB", "the capture folder's files past this total are deleted, oldest first", kind=SIZE, min=4096
    )
