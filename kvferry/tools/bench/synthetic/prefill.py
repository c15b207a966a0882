"""The synthetic prefill worker (a TEST DOUBLE): answers a PrefillRequest at once as a real prefill worker does after
its compute: a FirstToken per choice to the gateway (the cycle's token at the choice's next output index), then for
the choices that go on the KV handoff to the chosen decode worker, one KVTransfer of no blocks (the decode double
needs none), sent from a socket named after this worker as the real sender's are. It computes nothing, so a request
that asks for what a model would have to compute (logprobs, a constraint) fails with a 400 that says so.
"""

import dataclasses
import time

import zmq

from kvferry.common import protocol as p
from kvferry.common.errors import InvalidRequest
from kvferry.common.peer_address import check_peer_address
from kvferry.common.transport import Channel, limit_socket
from kvferry.services.gateway_link import GatewayLink
from kvferry.tools.bench.synthetic.double import SEND_TIMEOUT_MS, SyntheticWorker, log

NO_KV_SHAPE = [1, 0, 0, 2, 0, 0]  # [layers, blocks, block_size, 2, kv_heads, head_dim]: a frame of no bytes


class SyntheticPrefill(SyntheticWorker):
    role = p.Role.PREFILL

    def __init__(self, gateways, model_folder, worker_id=None, block_size=16, counts_file=None):
        super().__init__(gateways, model_folder, worker_id, block_size, counts_file)
        self.to_decode: dict[str, Channel] = {}  # a decode worker's KV address -> the socket to it
        self.num_prompts = 0

    def stats(self) -> p.WorkerStats:
        return dataclasses.replace(super().stats(), num_prompts_prefilled=self.num_prompts)

    def on_gateway_message(self, link: GatewayLink, env: p.Envelope) -> None:
        if not isinstance(env.message, p.PrefillRequest):
            return  # an Abort: nothing is held here once the first tokens are out
        msg = env.message
        try:
            self.check(msg)
        except InvalidRequest as exc:
            link.channel.send(p.RequestFailed(str(exc), 400, msg.attempt), env.request_id, env.trace)
            return
        self.num_prompts += 1
        start = len(msg.resume_token_ids)
        token = self.cycle[start % len(self.cycle)]
        reason = self.finish_reason(msg.sampling, token, start, len(msg.prompt_token_ids))
        choices = [msg.choice] if msg.resume_token_ids else list(range(msg.n))
        for choice in choices:
            first = p.FirstToken(token, reason, choice=choice, attempt=msg.attempt, start=start)
            self.send_waiting(link.channel, first, env.request_id, env.trace)
        if reason < 0:
            self.hand_over(link, env, choices, token)

    @staticmethod
    def check(msg: p.PrefillRequest) -> None:
        params = msg.sampling
        if params.logprobs is not None or params.prompt_logprobs is not None or params.constraint is not None:
            raise InvalidRequest("the synthetic workers (a test double) compute no logprobs and follow no constraint")
        if not 1 <= msg.n <= p.MAX_CHOICES:
            raise InvalidRequest(f"n must be between 1 and {p.MAX_CHOICES}, got {msg.n}")
        check_peer_address(msg.decode_address)

    def hand_over(self, link: GatewayLink, env: p.Envelope, choices: list[int], token: int) -> None:
        msg = env.message
        transfer = p.KVTransfer(
            prefill_worker_id=self.worker_id,
            prompt_token_ids=msg.prompt_token_ids,
            output_token_ids=[token] * len(choices),
            choices=choices,
            sampling=msg.sampling,
            num_computed_tokens=len(msg.prompt_token_ids) + len(msg.resume_token_ids),
            dtype="float32",
            shape=NO_KV_SHAPE,
            deadline_s=msg.deadline_s,
            sent_at=time.time(),
            attempt=msg.attempt,
            resume_token_ids=msg.resume_token_ids,
            gateway_id=link.gateway_id,
        )
        self.send_waiting(self.decode_channel(msg.decode_address), transfer, env.request_id, env.trace, frames=[b""])

    def decode_channel(self, address: str) -> Channel:
        channel = self.to_decode.get(address)
        if channel is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, self.worker_id.encode())
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
            limit_socket(sock, p.max_header_bytes(*p.KV_SENDER_RECEIVES), p.max_header_bytes(p.Kind.KV_TRANSFER))
            sock.connect(address)
            channel = self.to_decode[address] = Channel(sock, f"{self.worker_id}/kv-out", peer_name=address)
            self.watch(sock, lambda: self.read_acks(channel))
        return channel

    def read_acks(self, channel: Channel) -> None:
        while channel.socket.poll(0):
            received = channel.recv()
            ack = received[1].message if received else None
            if isinstance(ack, p.KVAck) and not ack.accepted:  # the decode double told the gateway nothing: say it
                log.warning("%s: %s refused a transfer: %s", self.worker_id, channel.peer_name, ack.reason)

    def close(self) -> None:
        for channel in self.to_decode.values():
            channel.close()
        super().close()
