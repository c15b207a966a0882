from kvferry.common import protocol as p
from kvferry.services.gateway.registry import Registry


def register(reg, wid, role, now=0.0, **kw):
    fields = dict(
        role=int(role),
        worker_id=wid,
        model="m",
        dtype="float32",
        block_size=16,
        num_blocks=100,
        max_model_len=512,
        kv_address="tcp://d:1" if role == p.Role.DECODE else "",
    )
    fields.update(kw)
    return reg.register(p.Register(**fields), wid.encode(), now)


def beat(reg, wid, now, free=100, running=0, queued=0):
    return reg.heartbeat(p.Heartbeat(wid, p.WorkerStats(free, 100, running, 0, queued)), now)


def test_mismatched_workers_are_refused_with_the_reason():
    reg = Registry(expected_model="m", expected_block_size=16)
    assert register(reg, "p0", p.Role.PREFILL) is None
    assert "model mismatch" in register(reg, "x", p.Role.PREFILL, model="other")
    assert "block size mismatch" in register(reg, "y", p.Role.DECODE, block_size=8)
    assert "dtype mismatch" in register(reg, "z", p.Role.DECODE, dtype="bfloat16")  # the first worker set it
    assert "quantization mismatch" in register(reg, "q", p.Role.DECODE, quantization="int8")
    assert "KV ingress" in register(reg, "d", p.Role.DECODE, kv_address="")
    assert set(reg.workers) == {"p0"}


def test_routing_prefers_least_queued_prefill_and_roomiest_decode():
    reg = Registry()
    for wid, role in (("p0", p.Role.PREFILL), ("p1", p.Role.PREFILL), ("d0", p.Role.DECODE), ("d1", p.Role.DECODE)):
        register(reg, wid, role)
    beat(reg, "p0", 1, queued=500)
    beat(reg, "p1", 1, queued=20)
    beat(reg, "d0", 1, free=40, running=3)
    beat(reg, "d1", 1, free=60, running=9)
    assert reg.pick_prefill()[0].worker_id == "p1" and reg.pick_decode().worker_id == "d1"
    beat(reg, "d1", 2, free=40, running=9)  # a tie on free blocks: fewer running sequences wins
    assert reg.pick_decode().worker_id == "d0"
    reg.assign(reg.workers["p1"], reg.workers["d0"], num_prompt_tokens=1000, num_blocks=63)
    # Until the next heartbeat, what was just routed counts against them.
    assert reg.pick_prefill()[0].worker_id == "p0" and reg.pick_decode().worker_id == "d1"


def test_silent_workers_expire_and_must_register_again():
    reg = Registry(heartbeat_interval_s=1.0)
    register(reg, "p0", p.Role.PREFILL, now=0.0)
    register(reg, "d0", p.Role.DECODE, now=0.0)
    beat(reg, "d0", 2.5)
    assert [w.worker_id for w in reg.expire(3.5)] == ["p0"]
    assert reg.pick_prefill() == (None, 0) and reg.pick_decode().worker_id == "d0"
    assert not beat(reg, "p0", 4.0)  # unknown now: the gateway asks it to register again


def test_a_draining_worker_gets_nothing_new_but_stays_live():
    reg = Registry()
    register(reg, "d0", p.Role.DECODE)
    register(reg, "d1", p.Role.DECODE)
    beat(reg, "d0", 0.5, free=500)
    beat(reg, "d1", 0.5, free=100)
    assert reg.pick_decode().worker_id == "d0"
    reg.workers["d0"].draining = True
    assert reg.pick_decode().worker_id == "d1"
    assert {w.worker_id for w in reg.live(p.Role.DECODE)} == {"d0", "d1"}
    reg.workers["d1"].draining = True
    assert reg.pick_decode() is None and not reg.routable(p.Role.DECODE)


def test_prefill_routing_follows_cached_prefixes_balanced_against_queued_work():
    from kvferry.common.block_hash import block_hashes

    reg = Registry()
    for wid in ("p0", "p1"):
        register(reg, wid, p.Role.PREFILL)
    system = list(range(100, 100 + 16 * 25))  # a 400-token system prompt: 25 blocks
    prompt = system + [7, 8, 9]
    hashes = block_hashes(prompt, 16)
    beat(reg, "p0", 1, queued=0)
    beat(reg, "p1", 1, queued=100)
    reg.cache_update(p.CacheUpdate("p1", hashes[:25], full=True))
    # p1 holds the 400 prefix tokens: 100 queued + 3 to compute beats 0 queued + 403.
    assert reg.pick_prefill(hashes, len(prompt)) == (reg.workers["p1"], 25)
    beat(reg, "p1", 2, queued=1000)  # too busy now: computing it all on p0 is sooner
    assert reg.pick_prefill(hashes, len(prompt))[0].worker_id == "p0"
    # Deltas: an evicted first block breaks the whole chain; a stored block counts again.
    beat(reg, "p1", 3, queued=100)
    reg.cache_update(p.CacheUpdate("p1", [], evicted=[hashes[0]]))
    assert reg.pick_prefill(hashes, len(prompt)) == (reg.workers["p0"], 0)
    reg.cache_update(p.CacheUpdate("p1", [hashes[0]]))
    assert reg.pick_prefill(hashes, len(prompt))[1] == 25
    # Routing a prompt counts its blocks as cached where it went: the next of a burst follows it there.
    register(reg, "d0", p.Role.DECODE)
    other = block_hashes(list(range(5000, 5400)) + [1], 16)
    first, _ = reg.pick_prefill(other, 401)
    reg.assign(first, reg.workers["d0"], 401, 26, other)
    assert reg.pick_prefill(other, 401) == (first, 25)
    reg.cache_update(p.CacheUpdate("nobody", hashes))  # an unknown worker's update is ignored
    # A prompt prefilled there no longer counts against it, even before the next heartbeat says so.
    reg.prefilled(first.worker_id, 401)
    assert first.pending_prompt_tokens == 0
    reg.prefilled("nobody", 5)


def test_a_moved_request_goes_to_other_workers_first_and_back_only_when_none_is_left():
    reg = Registry()
    for wid in ("d0", "d1"):
        register(reg, wid, p.Role.DECODE)
    beat(reg, "d0", 0.0, free=100)
    beat(reg, "d1", 0.0, free=10)
    assert reg.pick_decode().worker_id == "d0"
    assert reg.pick_decode(avoid=frozenset({b"d0"})).worker_id == "d1"
    assert reg.pick_decode(avoid=frozenset({b"d0", b"d1"})).worker_id == "d0"  # none other: the best of them


def test_what_a_worker_is_believed_to_cache_is_bounded_by_its_blocks():
    reg = Registry()
    register(reg, "p0", p.Role.PREFILL)  # 100 blocks
    reg.cache_update(p.CacheUpdate("p0", [i.to_bytes(16, "big") for i in range(10_000)], full=True))
    worker = reg.workers["p0"]
    assert len(worker.cached) == 200
    reg.assign(worker, worker, 0, 0, [b"x" * 16] * 5)  # routing adds nothing past the bound either
    assert len(worker.cached) == 200
    reg.cache_update(p.CacheUpdate("p0", [b"a" * 16], full=True))  # a full update replaces the stale view
    assert worker.cached == {b"a" * 16}
