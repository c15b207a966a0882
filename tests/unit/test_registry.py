from kvferry.common import protocol as p
from kvferry.services.gateway.registry import Registry


def register(reg, wid, role, now=0.0, **kw):
    fields = dict(role=int(role), worker_id=wid, model="m", dtype="float32", block_size=16, num_blocks=100,
                  max_model_len=512, kv_address="tcp://d:1" if role == p.Role.DECODE else "")
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
    assert reg.pick_prefill().worker_id == "p1" and reg.pick_decode().worker_id == "d1"
    beat(reg, "d1", 2, free=40, running=9)  # a tie on free blocks: fewer running sequences wins
    assert reg.pick_decode().worker_id == "d0"
    reg.assign(reg.workers["p1"], reg.workers["d0"], num_prompt_tokens=1000, num_blocks=63)
    # Until the next heartbeat, what was just routed counts against them.
    assert reg.pick_prefill().worker_id == "p0" and reg.pick_decode().worker_id == "d1"


def test_silent_workers_expire_and_must_register_again():
    reg = Registry(heartbeat_interval_s=1.0)
    register(reg, "p0", p.Role.PREFILL, now=0.0)
    register(reg, "d0", p.Role.DECODE, now=0.0)
    beat(reg, "d0", 2.5)
    assert [w.worker_id for w in reg.expire(3.5)] == ["p0"]
    assert reg.pick_prefill() is None and reg.pick_decode().worker_id == "d0"
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
