"""The decode worker: receives prompts' KV from prefill workers into its block pool, and batches generation
continuously, streaming each step's tokens to the gateway. The loop owns the sockets; its DecodeConnector
(services/decode/connector.py) owns every transfer and attempt, and the loop sends what it has to say. Each choice
runs as an engine sequence keyed by ChoiceKey.
"""

import time

import zmq

from kvferry.common import protocol as p
from kvferry.common import settings
from kvferry.common.bind_check import bind_zmq, check_exposed
from kvferry.common.errors import KvferryError
from kvferry.common.memory_budget import kv_cache_ceiling, most_kv_cache
from kvferry.common.model.kv_blocks import layer_groups
from kvferry.common.model_files import read_config, resolve_model
from kvferry.common.process_config import ProcessConfig
from kvferry.common.request_failure import fails_alone
from kvferry.common.transport import Channel, limit_socket
from kvferry.common.worker_config import WorkerConfig
from kvferry.services.decode.connector import DecodeConnector, Reply
from kvferry.services.gateway_link import GatewayLink
from kvferry.services.request_keys import AttemptKey
from kvferry.services.worker import Worker, advertised_host


def max_kv_frame_bytes(engine) -> int:
    """The largest legal KV frame this engine can take: its largest layer group, of every block in its pool."""
    largest_group = max(hi - lo for lo, hi in engine.layer_groups)
    return largest_group * engine.num_blocks * (engine.bytes_per_block // engine.num_layers)


def kv_frame_bound(config) -> int:
    """max_kv_frame_bytes, or a hair above, before the engine exists (ZeroMQ takes a socket's size limit as it binds,
    before the model loads): the largest layer group's share of the KV cache budget."""
    model_dir = resolve_model(config.model)
    num_layers = read_config(model_dir)["num_hidden_layers"]
    largest_group = max(hi - lo for lo, hi in layer_groups(num_layers))
    # Sized from memory: no more than the machine has, nor than the engine could fill (in float32, the widest)
    budget = config.kv_cache_memory or min(kv_cache_ceiling(), most_kv_cache(model_dir, config, 4))
    return largest_group * budget // num_layers


class DecodeWorker(Worker):
    role = p.Role.DECODE

    def __init__(self, config, gateway, worker_id=None, worker_config=None, process=None, **kwargs):
        worker_config, process = worker_config or WorkerConfig(), process or ProcessConfig()
        kv_bind = worker_config.kv_bind
        # Bound before the model loads (in Worker.__init__): a taken port fails at once.
        curve = kwargs.get("curve")
        self.auth = curve.authenticator(zmq.Context.instance()) if curve else None
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # A prefill worker that reconnects before its old connection died takes its name over; not under CURVE, where
        # another prefill key could take a live worker's name, and the acks sent to it (as at the gateway).
        sock.setsockopt(zmq.ROUTER_HANDOVER, 0 if curve else 1)
        # A frame past one layer group of the whole pool is no transfer: refused before ZeroMQ buffers it.
        frame_limit = max(kv_frame_bound(config), p.max_header_bytes(*p.KV_INGRESS_RECEIVES))
        limit_socket(sock, frame_limit)
        if curve:
            curve.serve(sock)
        bind_zmq(sock, kv_bind, settings.label("kv_bind"))
        exposed_as = f"{worker_id or 'the decode worker'}'s KV ingress"
        check_exposed(kv_bind, exposed_as, curve=curve is not None, insecure=process.insecure)
        connector = lambda wid: DecodeConnector(wid, self.tracer)  # noqa: E731
        super().__init__(
            config, gateway, worker_id, connector=connector, worker_config=worker_config, process=process, **kwargs
        )
        self.connector: DecodeConnector = self.engine.connector
        self.connector.serve(self.link_named, self.compiles, self.trace_compile)
        if max_kv_frame_bytes(self.engine) > frame_limit:  # the bound's reasoning no longer holds: a bug
            raise KvferryError(f"a KV frame may be {max_kv_frame_bytes(self.engine)} bytes, past {frame_limit}")
        endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        host, port = endpoint.rsplit(":", 1)
        if host.endswith(("0.0.0.0", "*")):
            host = "tcp://" + advertised_host(worker_config.advertise_host)
        self.advertised_kv = f"{host}:{port}"
        self.kv_in = Channel(sock, f"{self.worker_id}/kv")
        self.poller.register(sock, zmq.POLLIN)
        self.num_steps = 0

    def kv_address(self) -> str:
        return self.advertised_kv

    def channel_for(self, sock) -> Channel:
        return self.kv_in if sock is self.kv_in.socket else super().channel_for(sock)

    def num_protocol_errors(self) -> int:
        return super().num_protocol_errors() + self.kv_in.num_protocol_errors

    # -- what comes in, handed to the connector; what it has to say, sent -----------------------------------
    def handle(self, channel, peer, env: p.Envelope) -> None:
        try:
            self.connector.on_message(peer, env)
        finally:
            self.flush()

    def on_compiled(self, done) -> None:
        try:
            self.connector.on_compiled(done)
        finally:
            self.flush()

    def tidy(self) -> None:
        self.connector.tidy()
        self.flush()

    def forget_request(self, request_id: str, attempt: int) -> None:
        self.connector.end(AttemptKey(request_id, attempt))
        self.flush()

    def flush(self) -> None:
        """Send what the connector has to say: replies to prefill workers, failures to gateways."""
        for item in self.connector.take_outbox():
            if isinstance(item, Reply):
                self.kv_in.send(item.message, item.request_id, item.trace, to=item.peer)
            else:
                self.report(item)

    # -- a step -----------------------------------------------------------------------------------------------
    def step(self) -> None:
        started = time.time()
        outputs = self.engine.step()
        if self.engine.last_plan.chunks:
            self.num_steps += 1
            if self.tracer.enabled:
                self.trace_step(self.engine.last_plan, started)
        try:
            for link, sends in self.connector.on_outputs(outputs).items():
                self.send_tokens(link, sends)
        finally:
            self.flush()

    def send_tokens(self, link: GatewayLink, sends: list[tuple[AttemptKey, p.Tokens, p.TraceContext | None]]) -> None:
        """A step's tokens for one gateway: one TokenBatch (more past its size limit) where the gateway takes them,
        else a Tokens per choice. A send that raises fails the requests it carried alone."""
        if not link.token_batches:
            for key, tokens, trace in sends:
                with fails_alone(lambda exc: self.connector.unsent(key, link, trace, exc)):
                    link.channel.send(tokens, key.request_id, trace)
            return
        done = 0
        for batch in p.token_batches([(key.request_id, tokens) for key, tokens, _ in sends]):
            carried = sends[done : done + len(batch.sequences)]
            done += len(carried)
            with fails_alone(lambda exc: [self.connector.unsent(key, link, trace, exc) for key, _, trace in carried]):
                link.channel.send(batch, entries=[(key.request_id, trace) for key, _, trace in carried])

    def trace_step(self, plan, started: float) -> None:
        """The step as a span, naming its requests (not their choices' engine ids)."""
        rids = dict.fromkeys(c.seq.request_id.request_id for c in plan.chunks)
        self.tracer.span(
            "decode.step" if not plan.is_prefill else "decode.recompute",
            started,
            time.time(),
            step=self.num_steps,
            batch_size=len(plan.chunks),
            num_tokens=plan.num_tokens,
            num_preempted=len(plan.preempted),
            rids=list(rids),
        )

    def close(self) -> None:
        self.kv_in.close()
        super().close()
        if self.auth:
            self.auth.stop()
