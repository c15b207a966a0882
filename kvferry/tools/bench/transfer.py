"""`kvferry bench transfer`: a prompt's KV transfer against raw ZeroMQ over the same TCP loopback, in one run.

A sink process binds a ROUTER socket, as a decode worker's KV ingress does. Rounds alternate the workers' path (a
KVTransfer per layer group, each gathered from a paged cache while the one before is on the wire, placed into the
sink's own blocks) and raw (as many bytes in one preallocated frame). Each figure runs from the send, the gather
included, to the acknowledgement.
"""

import json
import multiprocessing
import random
import statistics
import sys
import time

import numpy as np
import torch
import zmq

from kvferry.common import protocol as p
from kvferry.common.model.cpu_memory import huge_page_zeros, keep_freed_memory
from kvferry.common.model.kv_blocks import (
    LAYER_GROUPS,
    as_frames,
    frame_tensor,
    gather_blocks,
    layer_groups,
    scatter_blocks,
)
from kvferry.common.sampling import SamplingParams
from kvferry.common.transport import Channel

RAW, STOP = b"raw", b"stop"


def _sink(endpoint_queue, shape: tuple) -> None:
    torch.set_num_threads(1)
    keep_freed_memory()  # as in the workers: a gather or a receive buffer reuses heap, not fresh pages
    sock = zmq.Context().socket(zmq.ROUTER)
    sock.bind("tcp://127.0.0.1:0")
    endpoint_queue.put(sock.getsockopt(zmq.LAST_ENDPOINT).decode())
    channel = Channel(sock, "bench/sink")
    kv_cache = huge_page_zeros((*shape[:3], 2, *shape[3:]), torch.float32)  # the runner's pool: layout and pages
    block_ids = list(range(shape[1]))[::-1]
    while True:
        parts = sock.recv_multipart(copy=False)
        if parts[1].bytes == STOP:
            return
        if parts[1].bytes == RAW:
            sock.send_multipart([parts[0], b"ok"])
            continue
        peer, env = channel.unpack(parts)
        msg = env.message
        kv = frame_tensor(env.frames[0], msg.dtype, msg.shape)
        layers = (msg.layer_start, msg.layer_start + msg.shape[0])
        scatter_blocks(kv_cache, block_ids[: msg.shape[1]], kv, layers)
        if layers[1] == shape[0]:
            channel.send(p.KVAck(True), env.request_id, to=peer)


def measure(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    num_blocks: int,
    rounds: int,
    num_groups: int = LAYER_GROUPS,
) -> dict:
    keep_freed_memory()
    shape = (num_layers, 4 * num_blocks, block_size, 2, num_kv_heads, head_dim)  # the runner's cache layout
    spawn = multiprocessing.get_context("spawn")
    endpoints = spawn.Queue()
    sink = spawn.Process(
        target=_sink, args=(endpoints, (num_layers, num_blocks, block_size, num_kv_heads, head_dim)), daemon=True
    )
    sink.start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoints.get(timeout=60))
    channel = Channel(sock, "bench/source")
    kv_cache = huge_page_zeros(shape, torch.float32)
    kv_cache.normal_()
    block_ids = random.Random(0).sample(range(shape[1]), num_blocks)  # scattered, as a pool's blocks are
    nbytes = 2 * num_layers * num_blocks * block_size * num_kv_heads * head_dim * 4
    raw_frames = [np.ones(nbytes, dtype=np.uint8)]
    groups = layer_groups(num_layers, num_groups)
    sampling = SamplingParams(max_tokens=1, temperature=0, top_p=1, top_k=0, seed=None, ignore_eos=True)

    def kv_once() -> float:
        started = time.perf_counter()
        for lo, hi in groups:  # as PrefillWorker.send_kv does
            kv = gather_blocks(kv_cache, block_ids, (lo, hi))
            msg = p.KVTransfer(
                "bench",
                [1] * (num_blocks * block_size),
                [1],
                [0],
                sampling,
                num_blocks * block_size,
                "float32",
                list(kv.shape),
                deadline_s=1e12,
                layer_start=lo,
            )
            channel.send(msg, "bench", frames=as_frames(kv))
        channel.recv()
        return time.perf_counter() - started

    def raw_once() -> float:
        started = time.perf_counter()
        sock.send_multipart([RAW, *raw_frames], copy=False)
        sock.recv_multipart()
        return time.perf_counter() - started

    try:
        raw_once(), kv_once()  # connect, and first-touch the buffers
        raw_s, kv_s = [], []
        for _ in range(rounds):
            raw_s.append(raw_once())
            kv_s.append(kv_once())
        sock.send_multipart([STOP])
    finally:
        sink.join(timeout=10)
        if sink.is_alive():
            sink.kill()
        sock.close()
    raw, kv = statistics.median(raw_s), statistics.median(kv_s)
    return {
        "num_blocks": num_blocks,
        "layer_groups": len(groups),
        "mib": round(nbytes / 2**20, 1),
        "rounds": rounds,
        "raw_ms": round(raw * 1000, 2),
        "kv_ms": round(kv * 1000, 2),
        "raw_gib_per_s": round(nbytes / raw / 2**30, 2),
        "kv_gib_per_s": round(nbytes / kv / 2**30, 2),
        "kv_vs_raw": round(raw / kv, 3),
    }


def cmd_bench_transfer(args) -> int:
    from kvferry.common.model_config import ModelConfig
    from kvferry.common.model_files import resolve_model

    torch.set_num_threads(1)
    config = ModelConfig.load(resolve_model(args.model))
    layout = (config.num_hidden_layers, config.num_key_value_heads, config.head_dim, 16)
    results = []
    for num_blocks in args.blocks:
        for num_groups in args.layer_groups or [1, LAYER_GROUPS]:
            results.append(measure(*layout, num_blocks, args.rounds, num_groups))
            print(json.dumps(results[-1]), file=sys.stderr)
    if args.json:
        print(json.dumps({"layout": layout, "results": results}))
        return 0
    print(
        f"\n== KV transfer vs raw ZeroMQ, tcp://127.0.0.1, float32, {layout[0]} layers x {layout[1]} kv heads x "
        f"{layout[2]} dims, blocks of 16 (medians of {args.rounds}) =="
    )
    for r in results:
        print(
            f"{r['num_blocks']:>4} blocks ({r['mib']:>6} MiB) in {r['layer_groups']:>2} messages: kv {r['kv_ms']:>7} ms {r['kv_gib_per_s']:>5} GiB/s, "
            f"raw {r['raw_ms']:>7} ms {r['raw_gib_per_s']:>5} GiB/s -> {r['kv_vs_raw']:.0%} of raw"
        )
    return 0
