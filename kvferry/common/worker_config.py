"""A worker's settings (WorkerConfig), each declared once as a field: its default, bounds and help. `kvferry prefill`
and `kvferry decode` take them (the decode worker its KV ingress too), beside their engine's (EngineConfig)."""

from kvferry.common.peer_address import MAX_PORT
from kvferry.common.setting import DECODE, SERVE, SIZE, WORKERS, setting, settings_class

_AND_SERVE = (*WORKERS, SERVE)
_DECODE_ONLY = (DECODE,)


@settings_class(WORKERS, "worker")
class WorkerConfig:
    gateway: str = setting(
        "tcp://127.0.0.1:5557",
        "the gateway's control address; several, comma-separated, to serve gateways that share this worker",
    )
    worker_id: str | None = setting(
        None, "this worker's name in logs, traces and /v1/workers; default: the role and a random suffix"
    )
    grammar_compile_timeout: float = setting(
        5,
        "a structured-output constraint not compiled this long (seconds) after it reached a worker's compile queue "
        "fails: a 400 when its own compile took most of it (that compile is killed), else a 503 that another worker "
        "may take; at most 8, below the 10 s a prefill worker waits for a decode worker to take a transfer (the "
        "set-up of the tokenizer, xgrammar and the compile process, about 3 s on a 2-core CPU once and again after "
        "each kill, is not counted)",
        above=0,
        max=8,
        commands=_AND_SERVE,
    )
    grammar_cache_bytes: int = setting(
        "256MiB",
        "the compiled structured-output grammars a worker keeps, by the memory they hold (a large enum's holds tens "
        "of MiB, an ordinary schema's tens of KiB); one larger than this is served, not kept. The default fits a "
        "4 GiB worker beside the default model (540 MB), its 1 GiB KV cache, torch and the compile process",
        kind=SIZE,
        min=0,
        commands=_AND_SERVE,
    )
    stall_timeout: float = setting(
        30, "report unhealthy (the gateway moves the requests) when the step loop is stuck this long", above=0
    )
    health_port: int | None = setting(
        None,
        "serve GET /health (registered and stepping) and /live (loop not stuck) on this port, on every "
        "interface: the kubelet probes the pod's address (default: off)",
        min=1,
        max=MAX_PORT,
    )
    kv_bind: str = setting(
        "tcp://127.0.0.1:0", "where prefill workers send KV (port 0: any free port)", commands=_DECODE_ONLY
    )
    advertise_host: str | None = setting(
        None,
        "the address prefill workers reach a 0.0.0.0 --kv-bind at (default: this host's IP; in Kubernetes, "
        "give the pod IP)",
        commands=_DECODE_ONLY,
    )
    curve_client: str | None = setting(
        None,
        "the CURVE client key pair this worker presents, DIR/NAME.key_secret (default: its role, prefill or decode); "
        "a pair of its own (kvferry keys DIR --client NAME) can be revoked alone",
        metavar="NAME",
        section="security",
    )
