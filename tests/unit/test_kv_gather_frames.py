"""KV gathered from a CUDA cache arrives in pinned memory while the copy may still run (kv_gather.py): its frame
waits for the copy, and the KV sender's thread does that waiting before the bytes go on the wire. On the CPU the
copy is played by an event that fills the buffer only when waited for."""

import pytest
import torch
import zmq

from kvferry.common import protocol as p
from kvferry.common.model.kv_blocks import as_frames, frame_tensor, gather_blocks, scatter_blocks
from kvferry.common.sampling import SamplingParams
from kvferry.common.transport import Channel
from kvferry.services.prefill.kv_sender import KVSender, Outgoing

SHAPE = [2, 3, 4, 2, 1, 2]  # [layers, blocks, block_size, 2, kvh, d]


class CopyOnWait:
    """A device-to-host copy's event: the host buffer holds the bytes only once someone has waited."""

    def __init__(self, host: torch.Tensor, source: torch.Tensor):
        self.host, self.source = host, source

    def synchronize(self) -> None:
        self.host.copy_(self.source)


def pending_kv() -> tuple[torch.Tensor, torch.Tensor]:
    values = torch.arange(torch.Size(SHAPE).numel(), dtype=torch.float32).view(SHAPE)
    host = torch.zeros(SHAPE)
    host.copied = CopyOnWait(host, values)
    return host, values


def test_the_sender_waits_for_the_copy_before_the_bytes_go():
    host, values = pending_kv()
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    sender = KVSender(ctx, "p0")
    message = p.KVTransfer("p0", [1, 2, 3], [], [0], SamplingParams(), 3, "float32", SHAPE, 1e12)
    try:
        sender.send(Outgoing(f"tcp://127.0.0.1:{port}", "d0", message, "r1", p.TraceContext(), as_frames(host)))
        assert router.poll(5000), "nothing arrived"
        _, envelope = Channel(router, "d0").recv()
        assert torch.equal(frame_tensor(envelope.frames[0], "float32", SHAPE), values)
    finally:
        sender.close()
        router.close(linger=0)
        ctx.term()


def test_placing_pending_kv_waits_for_its_copy():
    host, values = pending_kv()
    cache = torch.zeros(2, 5, 4, 2, 1, 2)
    scatter_blocks(cache, [4, 0, 2], host)
    assert torch.equal(gather_blocks(cache, [4, 0, 2]), values)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side stream and pinned memory need CUDA")
def test_a_cuda_gather_equals_the_host_gather():
    from kvferry.common.model.kv_gather import DeviceGather

    cache = torch.randn(4, 9, 4, 2, 1, 2, generator=torch.Generator().manual_seed(0))
    on_device = cache.cuda()
    gathered = DeviceGather(on_device.device).gather(on_device, [7, 1, 3], (1, 3))
    assert gathered.is_pinned() and hasattr(gathered, "copied")
    [frame] = as_frames(gathered)
    array = frame.wait()  # a PendingFrame until the copy has run
    assert torch.equal(torch.from_numpy(array).view(gathered.dtype).view(gathered.shape), cache[1:3, [7, 1, 3]])
