"""The synthetic decode worker (a TEST DOUBLE): takes a prompt's KVTransfer from a (synthetic) prefill worker on
its KV ingress, acknowledges it, and from then on every step emits one token of the cycle for every sequence it
holds, as a real decode worker streams them: a step's Tokens (one per choice) in one TokenBatch per gateway, a
choice's first Tokens carrying the transfer's time, its last its finish reason (by the real engine's rules,
common/finish_rules.py). An Abort ends a request or one choice (a stop string at the gateway), also one whose KV has
not come yet. Steps come every step_interval_s, or with 0 as fast as the gateway takes the tokens (a full queue to it
holds the loop back).
"""

import time
from collections import OrderedDict
from dataclasses import dataclass

import zmq

from kvferry.common import protocol as p
from kvferry.common.transport import Channel, limit_socket
from kvferry.services.gateway_link import GatewayLink, link_named
from kvferry.tools.bench.synthetic.double import IDLE_POLL_MS, SyntheticWorker

MAX_ENDED = 4096  # (request, attempt) pairs remembered as ended, for a KVTransfer that comes after its Abort
WHOLE = -1  # an Abort's choice for the whole request


@dataclass(slots=True)
class Held:
    """One choice's sequence: what its Tokens messages need, and where its output stands."""

    request_id: str
    attempt: int
    choice: int
    link: GatewayLink
    trace: p.TraceContext
    position: int  # the index in the choice's output of the next token
    params: p.SamplingParams  # what its finish reason is judged by
    num_prompt_tokens: int
    transfer_s: float  # told with the first Tokens message, then 0


def tokens_message(seq: Held, token_ids: list[int], finish_reason: int) -> p.Tokens:
    """One choice's tokens of a step, the first at seq.position, as the real decode worker builds them
    (DecodeConnector.tokens_of)."""
    transfer_s, seq.transfer_s = seq.transfer_s, 0.0
    return p.Tokens(token_ids, int(finish_reason), transfer_s, 0, [], seq.choice, seq.attempt, seq.position)


class SyntheticDecode(SyntheticWorker):
    role = p.Role.DECODE

    def __init__(self, gateways, model_folder, worker_id=None, block_size=16, step_interval_s=0.0, counts_file=None):
        super().__init__(gateways, model_folder, worker_id, block_size, counts_file)
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        limit_socket(sock, p.max_header_bytes(*p.KV_INGRESS_RECEIVES))
        sock.bind("tcp://127.0.0.1:*")
        self.advertised_kv = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.kv_in = Channel(sock, f"{self.worker_id}/kv")
        self.watch(sock, self.read_kv)
        self.step_interval_s = step_interval_s
        self.next_step_at = 0.0
        self.requests: dict[tuple[str, int], dict[int, Held]] = {}  # (request id, attempt) -> choice -> sequence
        self.ended: OrderedDict[tuple[str, int], set[int]] = OrderedDict()  # choices ended before their KV came
        self.num_steps = 0

    def kv_address(self) -> str:
        return self.advertised_kv

    def num_running(self) -> int:
        return sum(map(len, self.requests.values()))

    def num_errors(self) -> int:
        return super().num_errors() + self.kv_in.num_protocol_errors

    # -- messages -----------------------------------------------------------------------------------------------
    def on_gateway_message(self, link: GatewayLink, env: p.Envelope) -> None:
        msg = env.message
        if not isinstance(msg, p.Abort):
            return
        key = (env.request_id, msg.attempt)
        seqs = self.requests.get(key)
        if seqs is None or msg.choice == WHOLE:
            self.requests.pop(key, None)
            self.remember_ended(key, msg.choice)
            return
        seqs.pop(msg.choice, None)
        if not seqs:
            del self.requests[key]

    def remember_ended(self, key: tuple[str, int], choice: int) -> None:
        self.ended.setdefault(key, set()).add(choice)
        self.ended.move_to_end(key)
        if len(self.ended) > MAX_ENDED:
            self.ended.popitem(last=False)

    def read_kv(self) -> None:
        sock = self.kv_in.socket
        while sock.poll(0):
            received = self.kv_in.recv()
            if received is None:
                continue
            peer, env = received
            if isinstance(env.message, p.KVTransfer):
                self.receive(peer, env)
            elif isinstance(env.message, p.KVQuery):  # holds nothing: the transfer brings every block
                self.kv_in.send(p.KVHeld(0, env.message.attempt), env.request_id, env.trace, to=peer)

    def receive(self, peer: bytes, env: p.Envelope) -> None:
        msg: p.KVTransfer = env.message
        link = link_named(self.links, msg.gateway_id)
        if link is None:
            reason = f"{self.worker_id} is not registered with gateway {msg.gateway_id!r}"
            self.kv_in.send(p.KVAck(False, reason, False, msg.attempt), env.request_id, env.trace, to=peer)
            return
        key = (env.request_id, msg.attempt)
        ended = self.ended.get(key, set())
        transfer_s = max(0.0, time.time() - msg.sent_at) + msg.gather_s if msg.sent_at else 0.0
        position = len(msg.resume_token_ids) + 1  # the first token came from prefill
        if WHOLE not in ended and key not in self.requests:
            seqs = {
                choice: Held(
                    env.request_id,
                    msg.attempt,
                    choice,
                    link,
                    env.trace,
                    position,
                    msg.sampling,
                    len(msg.prompt_token_ids),
                    transfer_s,
                )
                for choice in msg.choices
                if choice not in ended
            }
            if seqs:
                self.requests[key] = seqs
        self.kv_in.send(p.KVAck(True, attempt=msg.attempt), env.request_id, env.trace, to=peer)

    # -- steps --------------------------------------------------------------------------------------------------
    def poll_timeout_ms(self, now: float) -> int:
        if not self.requests:
            return IDLE_POLL_MS
        return max(0, min(IDLE_POLL_MS, int((self.next_step_at - now) * 1000) + 1)) if self.step_interval_s else 0

    def work(self) -> None:
        if not self.requests:
            return
        now = time.monotonic()
        if now < self.next_step_at:
            return
        self.next_step_at = now + self.step_interval_s
        self.step()

    def step(self) -> None:
        """One token for every sequence held, sent as the real worker sends a step's outputs (DecodeWorker.send_tokens):
        one TokenBatch per gateway that takes them, else a Tokens per sequence."""
        cycle, num_cycle = self.cycle, len(self.cycle)
        by_gateway: dict[GatewayLink, list[tuple[Held, p.Tokens]]] = {}
        for key, seqs in list(self.requests.items()):
            for choice, seq in list(seqs.items()):
                position = seq.position
                token = cycle[position % num_cycle]
                reason = self.finish_reason(seq.params, token, position, seq.num_prompt_tokens)
                by_gateway.setdefault(seq.link, []).append((seq, tokens_message(seq, [token], reason)))
                if reason >= 0:
                    del seqs[choice]
                else:
                    seq.position = position + 1
            if not seqs:
                del self.requests[key]
        for link, sends in by_gateway.items():
            if link.token_batches:
                for batch in p.token_batches([(seq.request_id, tokens) for seq, tokens in sends]):
                    self.send_waiting(link.channel, batch, "", None)
            else:
                for seq, tokens in sends:
                    self.send_waiting(link.channel, tokens, seq.request_id, seq.trace)
        self.num_steps += 1

    def close(self) -> None:
        self.kv_in.close()
        super().close()
